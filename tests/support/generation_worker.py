"""One rank of the generation test (tests/multirank/test_generation.py), launched under torchrun.

    torchrun --nproc_per_node 2 tests/support/generation_worker.py --model-dir D --out R --stage 3

Builds an engine (any backend) on the saved tiny model and runs generation phases through
Engine.generation_phase (zerotrain/backends/generation.py), writing <out>.<rank>.json:
- "same": this rank's share of GLOBAL_PROMPTS (prompt g on rank g % world), SAMPLES completions each, seeded
  by seed_of(g), under gather "phase" and "forward" (the test compares them with one process's HF generate);
- "uneven": rank 0's completions end at their first token (every token is its EOS) while rank 1's run to
  max_new_tokens; "phase" with a different number of calls per rank, "forward" with one call each;
- after a training step (every weight moved): prompt 0 again under both modes, then a second training step
  (the ZeRO-3 hooks and FSDP2 resharding back in place: it would fail otherwise);
- each phase's GenerationStats, this rank's parameter elements before/inside/after a "phase", whether torch's
  RNG state survived a phase, and the all-gathers this rank issued (counted at torch's ProcessGroup, not by the
  code under test) on entering the phase, inside its generate calls and on leaving it.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch

import tests.support.families as families

GLOBAL_PROMPTS = [[5, 17, 300, 41], [9, 2, 77], [100, 200, 300, 400, 500], [7, 8]]
"""Token ids of the global batch's prompts (different lengths: each call is one unpadded prompt)."""
SAMPLES = 4
"""Completions per prompt (num)."""
MAX_NEW = 12
EOS = list(range(0, 80))
"""EOS ids of the "same" phases: about 8% of the vocabulary, so some completions end early and some run out."""
LONG = 24
"""max_new_tokens of the uneven phases (rank 1's completions run all of it)."""


def seed_of(g: int, step: int = 0) -> int:
    """The caller's seed of prompt g of the global batch at a step (what the trainer derives from its run seed)."""
    return 1000 * (step + 1) + g


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", "--local-rank", type=int, default=None)
    for name, kind, default, what in (
            ("--model-dir", str, None, "the saved tiny model (families.make_model_dir)"),
            ("--out", str, None, "prefix of each rank's JSON (<out>.<rank>.json)"),
            ("--backend", str, "deepspeed", "backend"), ("--stage", int, 3, "zero.stage"),
            ("--dtype", str, "fp32", "precision.dtype"), ("--lora-r", int, 0, "lora.r (0: full fine-tuning)"),
            ("--lr", float, 0.05, "large, so one step changes what is sampled"),
            ("--timeout", float, 30.0, "dist_timeout_s: a hang fails fast")):
        p.add_argument(name, type=kind, default=default, required=default is None, help=what)
    p.add_argument("--gradient-checkpointing", action="store_true")
    return p.parse_args()


def local_elements(engine) -> int:
    """Parameter elements this rank holds now (ZeRO-3: a partitioned parameter's data is empty; FSDP2: a
    sharded parameter is a DTensor, an unsharded one a plain tensor)."""
    total = 0
    for p in engine.hf_model.parameters():
        total += p.to_local().numel() if hasattr(p, "to_local") else p.data.numel()
    return total


class AllGathers:
    """Counts the all-gathers this rank issues, at the process group itself (torch's ProcessGroup methods, below
    DeepSpeed's partition fetch and FSDP2's unshard alike), independently of GenerationStats: calls and gathered
    elements (the output's), per segment of a phase."""

    METHODS = ("all_gather_single", "allgather", "_allgather_base", "allgather_coalesced",
               "allgather_into_tensor_coalesced")

    def __init__(self):
        import torch.distributed as tdist

        self.calls, self.elements = 0, 0
        pg = tdist.ProcessGroup
        for name in self.METHODS:
            if hasattr(pg, name):
                setattr(pg, name, self._wrap(getattr(pg, name)))

    def _wrap(self, method):
        def counted(group, output, *args, **kwargs):
            self.calls += 1
            outs = output if isinstance(output, (list, tuple)) else [output]
            for o in outs:  # a tensor, or (allgather) a list per input of per-rank tensors
                for t in (o if isinstance(o, (list, tuple)) else [o]):
                    self.elements += t.numel()
            return method(group, output, *args, **kwargs)

        return counted

    def now(self) -> tuple[int, int]:
        return self.calls, self.elements


def since(then: tuple[int, int], now: tuple[int, int]) -> list[int]:
    return [now[0] - then[0], now[1] - then[1]]


def model_elements(engine) -> int:
    """The whole model's parameter elements (ZeRO-3: ds_numel; FSDP2: the DTensor's full shape)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in engine.hf_model.parameters())


def tied_elements(engine) -> int:
    """Elements of the input embedding when the output head shares it (GPT-2's tied wte), else 0."""
    m = engine.hf_model
    inp, out = m.get_input_embeddings(), m.get_output_embeddings()
    if out is None or out.weight is not inp.weight:
        return 0
    return getattr(inp.weight, "ds_numel", inp.weight.numel())


def dump(c) -> dict:
    return {"ids": c.completion_ids.tolist(), "lengths": c.lengths.tolist(), "truncated": c.truncated.tolist()}


def stats(engine) -> dict:
    out = asdict(engine.last_generation)
    out["tokens_per_s"] = engine.last_generation.tokens_per_s
    return out


def train_step(engine, step: int) -> float:
    g = torch.Generator().manual_seed(step * 10 + engine.rank)
    ids = torch.randint(0, families.VOCAB, (2, 16), generator=g)
    engine.train()
    loss = engine(**engine.to_device({"input_ids": ids, "labels": ids})).loss
    engine.backward(loss)
    assert engine.step()
    return float(loss.detach())


def main() -> int:
    a = parse()
    from zerotrain.backends.generation import SamplingParams
    from zerotrain.config.load import build_config
    from zerotrain.engine import build_engine

    cfg = build_config(overrides={
        "backend": a.backend, "zero.stage": a.stage, "precision.dtype": a.dtype, "batch.micro_batch": 2,
        "batch.grad_accum": 1, "optimizer.lr": a.lr, "optimizer.clip": 0.0, "schedule.name": "constant",
        "schedule.warmup_steps": 0, "dist_timeout_s": a.timeout, "run.seed": 0, "lora.r": a.lora_r,
        "lora.alpha": 2.0 * a.lora_r if a.lora_r else 16.0, "model.gradient_checkpointing": a.gradient_checkpointing})
    factory = families.builder(a.model_dir, "causal-lm", seed=0, gradient_checkpointing=a.gradient_checkpointing)
    engine = build_engine(factory, cfg, total_steps=4)
    rank, world = engine.rank, engine.world_size
    mine = [g for g in range(len(GLOBAL_PROMPTS)) if g % world == rank]
    result: dict = {"rank": rank, "world": world, "prompts": mine, "model_elements": model_elements(engine),
                    "tied_elements": tied_elements(engine)}
    gathers = AllGathers()

    def phase(name: str, params: SamplingParams, calls: list[tuple[int, int]]) -> None:
        """calls: (prompt index, seed) generated in order inside one phase."""
        rng = torch.get_rng_state()
        before = local_elements(engine)
        inside = None
        start = gathers.now()
        with engine.generation_phase(params) as gen:
            entered = gathers.now()
            inside = local_elements(engine)
            out = [dump(gen.generate(torch.tensor(GLOBAL_PROMPTS[g]), SAMPLES, seed)) for g, seed in calls]
            generated = gathers.now()
        result[name] = {"completions": out, "stats": stats(engine), "elements": [before, inside, local_elements(engine)],
                        "rng_kept": bool(torch.equal(rng, torch.get_rng_state())),
                        "allgathers": {"enter": since(start, entered), "generate": since(entered, generated),
                                       "exit": since(generated, gathers.now())}}

    same = dict(max_new_tokens=MAX_NEW, eos_token_id=EOS, pad_token_id=1, temperature=0.9, top_p=0.95, top_k=50)
    calls = [(g, seed_of(g)) for g in mine]
    phase("same_phase", SamplingParams(**same, gather="phase"), calls)
    phase("same_forward", SamplingParams(**same, gather="forward"), calls)

    ends_at_once = dict(eos_token_id=list(range(families.VOCAB))) if rank == 0 else dict(eos_token_id=None)
    uneven = dict(max_new_tokens=LONG, pad_token_id=1, **ends_at_once)
    phase("uneven_phase", SamplingParams(**uneven, gather="phase"), calls * (3 if rank == 0 else 1))
    phase("uneven_forward", SamplingParams(**uneven, gather="forward"), calls[:1])

    result["loss_1"] = train_step(engine, 1)
    after = [(0, seed_of(0, step=1))]
    phase("after_phase", SamplingParams(**same, gather="phase"), after)
    phase("after_forward", SamplingParams(**same, gather="forward"), after)
    phase("before_weights", SamplingParams(**same, gather="phase"), [(0, seed_of(0))])
    result["loss_2"] = train_step(engine, 2)

    try:
        engine.auxiliary("generation", lambda: None)
    except ValueError as e:
        result["auxiliary_refusal"] = str(e)
    Path(f"{a.out}.{rank}.json").write_text(json.dumps(result))
    engine.close()
    return 0


if __name__ == "__main__":
    from zerotrain.distributed import process_group as dist

    dist.exit_cleanly(main())
