"""Peer for benchmarks/lora_chat.py: HF Trainer + peft LoRA with zerotrain's own DeepSpeed config.

    torchrun --nproc_per_node 2 benchmarks/peers/hf_trainer_lora.py JOB_JSON RESULT_PREFIX

JOB_JSON: {"model": DIR, "data": chat.jsonl, "ds_config": the ds_config.json a zerotrain run wrote,
"seq_len", "micro_batch", "steps", "lr", "r", "alpha", "bf16"}. The data are zerotrain's own tokenized
chat rows (zerotrain.data.datasets.prepare_data: chatml, assistant-only labels, no packing), so both tools
train on the same samples; the DeepSpeed config is the very one zerotrain gave DeepSpeed (with its
ZeRO-3 leaf blocks, which need enable_input_require_grads here: see main). The step
clock is the shared one of benchmarks/common.py (on_step_end after the optimizer step).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, peers
import common as C  # noqa: E402
from peers import harness as H  # noqa: E402
from peers.hf_trainer import Clock, train_and_write  # noqa: E402


def main() -> None:
    from peft import LoraConfig, TaskType, get_peft_model

    from zerotrain.config.load import build_config
    from zerotrain.data.datasets import prepare_data

    job, out = json.loads(sys.argv[1]), sys.argv[2]
    H.init_gloo()
    rank = torch.distributed.get_rank()
    ds = json.loads(Path(job["ds_config"]).read_text())
    ds.pop("scheduler", None)
    cfg = build_config(overrides={"model.name": job["model"], "data.path": job["data"], "data.seq_len": job["seq_len"],
                                  "data.chat_template": "chatml"})
    data = prepare_data(cfg, AutoTokenizer.from_pretrained(job["model"]))
    opt = ds["optimizer"]["params"]  # HF refuses DeepSpeed values that differ from its arguments: take them over
    args = TrainingArguments(
        output_dir=f"{out}.trainer", deepspeed=ds, use_cpu=True, bf16=job["bf16"],
        per_device_train_batch_size=job["micro_batch"], gradient_accumulation_steps=ds["gradient_accumulation_steps"],
        learning_rate=opt["lr"], weight_decay=opt["weight_decay"], adam_beta1=opt["betas"][0],
        adam_beta2=opt["betas"][1], adam_epsilon=opt["eps"], max_grad_norm=ds.get("gradient_clipping", 1.0),
        lr_scheduler_type="constant", max_steps=job["steps"], seed=0, logging_steps=10**6, save_strategy="no",
        report_to=[], disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False)
    model = AutoModelForCausalLM.from_pretrained(job["model"])  # under zero.Init (stage-3 config)
    # zerotrain's config makes each Llama block a ZeRO-3 leaf module; behind peft's frozen embeddings a
    # block's input carries no grad and DeepSpeed's leaf hook then fails in backward ("size of tensor a
    # (0) must match ... (16)"; zerotrain guards its engine against it). peft's own remedy:
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=job["r"], lora_alpha=job["alpha"], target_modules="all-linear",
                                             task_type=TaskType.CAUSAL_LM))
    res = C.Result(rank=rank)
    trainer = Trainer(model=model, args=args, train_dataset=data.train, data_collator=data.collate,
                      callbacks=[Clock(res)])
    del model
    train_and_write(trainer, res, out)


if __name__ == "__main__":
    main()
