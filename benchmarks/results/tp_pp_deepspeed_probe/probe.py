"""Probe: does DeepSpeed's pipeline engine (PipelineModule / PipelineEngine) compose with AutoTP training
(config tensor_parallel.autotp_size) inside the stages? 4 CPU ranks, tiny Llama, tp 2 x pp 2.

    torchrun --nproc_per_node 4 benchmarks/results/tp_pp_deepspeed_probe/probe.py [plain|preset]

Each step is tried in order and the first failure is printed with its exception (the log beside this file)."""
import os
import traceback

import deepspeed
import torch
import transformers
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from zerotrain.backends.deepspeed.pipeline import pipe_layers, pipe_parts
from zerotrain.model.pipeline_parts import causal_lm_loss

rank = int(os.environ.get("RANK", "0"))


def say(*a):
    print(f"[rank {rank}]", *a, flush=True)


deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
model = transformers.LlamaForCausalLM(cfg)
ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1},
             "tensor_parallel": {"autotp_size": 2}, "steps_per_print": 1000}
layers, tied = pipe_layers(model)
parts = pipe_parts(len(layers) - 2, 2, tied)
topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)


class Stages(PipelineModule):
    def _partition_layers(self, method="uniform"):
        self.parts = parts
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=parts[stage], stop=parts[stage + 1])


import sys

variant = sys.argv[1] if len(sys.argv) > 1 else "plain"
if variant == "preset":  # the configurable AutoTP API: Llama's layer specs instead of the model-name parser
    ds_config["tensor_parallel"]["preset_model"] = "llama"
say("variant", variant, "tensor_parallel", ds_config["tensor_parallel"])
step = "PipelineModule(topology=pipe 2 x model 2 x data 1)"
try:
    pipe = Stages(layers=layers, topology=topo, loss_fn=causal_lm_loss, dynamic_shape=True)
    step = "deepspeed.initialize(PipelineModule, tensor_parallel.autotp_size=2)"
    engine, _, _, _ = deepspeed.initialize(model=pipe, model_parameters=[p for p in pipe.parameters()],
                                           config=ds_config)
    say("initialize ok:", type(engine).__name__)
    split = {n: tuple(p.shape) for n, p in engine.module.named_parameters() if "q_proj" in n}
    say("q_proj shapes after initialize (full is (32, 32)):", split)
    step = "train_batch"
    ids = torch.randint(0, 128, (1, 16))
    loss = engine.train_batch(data_iter=iter([(ids, ids), (ids, ids)]))
    say("train_batch ok, loss", float(loss))
    say("RESULT: composes" if any(s[0] != 32 for s in split.values()) else
        "RESULT: runs but AutoTP did not split the stage's layers (q_proj whole)")
except Exception as e:  # the probe's answer: what failed, where
    say(f"RESULT: FAILED at {step}: {type(e).__name__}: {e}")
    traceback.print_exc()
