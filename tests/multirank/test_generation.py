"""The engine's sharded generate (zerotrain/backends/generation.py) on 2 real ranks, against one process.

Each cell is one launch of tests/support/generation_worker.py; its checks:
- layout invariance: every rank's completions of its prompts (gather "phase") are bitwise those of transformers'
  generate in this process on the same model with the same settings and seed (TRL's sampling: temperature, top-p,
  top-k), and gather "forward" draws the same ones;
- the weights: "phase" holds the whole model on a sharded rank only inside the phase and gives it back at the end;
  "forward" never holds the whole model; unsharded layouts gather nothing. The all-gathers are counted at torch's
  ProcessGroup by the worker (not by the code under test): "phase" gathers every parameter element exactly once on
  entering the phase and nothing while generating; "forward" gathers, in every forward, everything the rank does not
  hold for the phase;
- the KV cache: after the prompt's forward every forward is fed one token (also with gradient checkpointing, which
  turns the model config's use_cache off);
- uneven lengths: rank 0's completions end at their first token, rank 1's run to max_new_tokens, with a 30 s
  collective timeout and the launch's hard timeout: "phase" finishes with rank 0 making 3x the calls and 1/24 of
  the forwards of rank 1; "forward" finishes with both ranks stepping together (the same forwards);
- after a training step: both modes draw the same (new) completions, not the old ones (the generator sees the
  weights training wrote), torch's RNG state survives every phase, and a second training step runs (the ZeRO-3
  hooks and FSDP2's resharding are back).

CI runs Llama under DeepSpeed ZeRO-3 and GPT-2 under FSDP2 stage 3, both with gradient checkpointing; the rest of
the matrix (Llama on FSDP2, GPT-2 under ZeRO-3, LoRA on both backends, the unsharded layouts: ZeRO-2 and DDP, FSDP2
stage 2) is slow.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import tests.support.generation_worker as gw
from tests.support.families import make_model_dir
from tests.support.launch import REPO, torchrun
from tests.support.matrix import cells

pytestmark = pytest.mark.multirank

WORKER = str(REPO / "tests" / "support" / "generation_worker.py")

CASES = [  # (family, backend, stage, extra worker flags)
    ("llama", "deepspeed", 3, ("--gradient-checkpointing",)),
    ("llama", "fsdp", 3, ()),
    ("gpt2", "fsdp", 3, ("--gradient-checkpointing",)),
    ("gpt2", "deepspeed", 3, ()),
    ("llama", "deepspeed", 3, ("--lora-r", "4")),
    ("gpt2", "fsdp", 3, ("--lora-r", "4")),
    ("llama", "fsdp", 2, ()),
    ("llama", "deepspeed", 2, ()),
    ("gpt2", "fsdp", 0, ()),
]


def _id(c) -> str:
    return f"{c[0]}-{c[1]}-z{c[2]}" + "".join("-" + f.strip("-").split("-")[0] for f in c[3] if f.startswith("--"))


SLOW = {_id(c) for c in CASES[1:] if c != ("gpt2", "fsdp", 3, ("--gradient-checkpointing",))}
"""CI: Llama under DeepSpeed ZeRO-3 and GPT-2 under FSDP2 stage 3, both with gradient checkpointing; the rest is
slow."""


_LOADED: dict = {}
"""The reference's models, loaded once per directory."""


def reference(model_dir: Path, prompt: list[int], seed: int) -> dict:
    """One process: transformers' generate with the worker's "same" settings (TRL's GenerationConfig kwargs) as
    transformers' own warpers, each row sampled by zerotrain's RowSampler with its row_seed (the sampler itself is
    proven against a plain per-row loop in tests/unit/test_generation.py); completions cut at their first EOS as
    TRL does."""
    from transformers import (AutoModelForCausalLM, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
                              TopPLogitsWarper)

    from zerotrain.backends.generation import RowSampler, row_seed

    if model_dir not in _LOADED:
        _LOADED[model_dir] = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model = _LOADED[model_dir]
    ids = torch.tensor([prompt] * gw.SAMPLES)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks (OMP_NUM_THREADS=1): the same kernels, bitwise
    try:
        processors = LogitsProcessorList([TemperatureLogitsWarper(0.9), TopKLogitsWarper(50), TopPLogitsWarper(0.95),
                                          RowSampler([row_seed(seed, g) for g in range(gw.SAMPLES)],
                                                     torch.device("cpu"))])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=gw.MAX_NEW, eos_token_id=gw.EOS, pad_token_id=1,
                                 logits_processor=processors, use_cache=True)
    finally:
        torch.set_num_threads(threads)
    rows, lengths, truncated = [], [], []
    for row in out[:, len(prompt):].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in gw.EOS), None)
        lengths.append(end or len(row))
        truncated.append(end is None)
        rows.append(row[:lengths[-1]] + [1] * (len(row) - lengths[-1]))
    return {"ids": rows, "lengths": lengths, "truncated": truncated}


def check_phase(r: dict, name: str, sharded: bool, prompts: list[list[int]]) -> None:
    """The weights held, the all-gathers issued and the KV cache of one phase. The all-gathers are counted by the
    worker at torch's ProcessGroup (under DeepSpeed's partition fetch and FSDP2's unshard), not by the code under
    test: [calls, gathered elements] on entering the phase, inside its generate calls and on leaving it."""
    s, (before, inside, after) = r[name]["stats"], r[name]["elements"]
    ag, whole = r[name]["allgathers"], r["model_elements"]
    assert r[name]["rng_kept"], name
    assert s["sharded"] == sharded and s["calls"] == len(prompts)
    assert after == before, (name, before, after)
    assert ag["exit"] == [0, 0], (name, ag)  # releasing gathers nothing
    if sharded and s["gather"] == "phase":
        # the whole model gathered once on entry (each parameter once: no padding on these shapes), none per forward
        assert ag["enter"][1] == whole and ag["generate"] == [0, 0], (name, ag, whole)
        assert s["gathers"] == 1 and inside == whole > before, (name, s["gathers"], before, inside)
    elif sharded:  # never the whole model (FSDP2 holds its root's own parameters: embeddings, head)
        held = ag["enter"][1]  # FSDP2: the root's parameters, for the phase; DeepSpeed: nothing
        assert held < whole and ag["generate"][0] >= s["forwards"] > 0, (name, ag, s["forwards"])
        # all, per forward; DeepSpeed may fetch a tied embedding twice in the one forward it traces (the embedding
        # and the head are two modules; it learns from that trace to keep it): at most once more
        extra = ag["generate"][1] - s["forwards"] * (whole - held)
        allowed = (0, r["tied_elements"]) if r["tied_elements"] and held == 0 else (0,)
        assert extra in allowed, (name, ag, s["forwards"], whole, r["tied_elements"])
        assert s["gathers"] == s["forwards"] and before <= inside < whole and s["lockstep"], (name, inside, whole)
    else:
        assert ag == {"enter": [0, 0], "generate": [0, 0], "exit": [0, 0]}, (name, ag)
        assert s["gathers"] == 0 and inside == before and not s["lockstep"], name
    widths = s["forward_widths"]  # each call: the prompt, then one token per forward (the KV cache)
    assert [w for w in widths if w != 1] == [len(p) for p in prompts], (name, widths)
    assert s["cached_forwards"] == s["forwards"] - s["calls"], (name, widths)


class _Models(dict):
    """family -> its saved tiny model, built on first use."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def __missing__(self, family: str) -> Path:
        self[family] = make_model_dir(family, self.root / family)
        return self[family]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    return _Models(tmp_path_factory.mktemp("generation"))


@pytest.mark.parametrize("family,backend,stage,flags", cells(CASES, SLOW, ids=_id))
def test_sharded_generation(tmp_path, models, family, backend, stage, flags):
    out = tmp_path / "gen"
    torchrun([WORKER, "--model-dir", models[family], "--out", out, "--backend", backend, "--stage", stage,
              "--timeout", 30, *flags], timeout=240)
    ranks = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in (0, 1)]
    sharded = stage == 3 or (backend == "fsdp" and stage > 0)
    lengths_seen = set()
    for r in ranks:
        prompts = [gw.GLOBAL_PROMPTS[g] for g in r["prompts"]]
        # layout invariance: bitwise one process's completions, in both modes
        for g, got in zip(r["prompts"], r["same_phase"]["completions"]):
            assert got == reference(models[family], gw.GLOBAL_PROMPTS[g], gw.seed_of(g)), (r["rank"], g)
            lengths_seen.update(got["lengths"])
        assert r["same_forward"]["completions"] == r["same_phase"]["completions"]
        check_phase(r, "same_phase", sharded, prompts)
        check_phase(r, "same_forward", sharded, prompts)
        check_phase(r, "after_phase", sharded, [gw.GLOBAL_PROMPTS[0]])
        # the generator sees the trained weights: both modes agree on new completions
        assert r["after_phase"]["completions"] == r["after_forward"]["completions"]
        old = reference(models[family], gw.GLOBAL_PROMPTS[0], gw.seed_of(0))
        assert r["before_weights"]["completions"] != [old], "a training step changed nothing that is sampled"
        assert math.isfinite(r["loss_1"]) and math.isfinite(r["loss_2"])
        assert "generation_phase" in r["auxiliary_refusal"]
    assert len(lengths_seen) > 2 and gw.MAX_NEW in lengths_seen  # some end early, some are truncated
    # uneven lengths per rank: both modes finished (no hang)
    short, long = ranks[0], ranks[1]
    for mode in ("uneven_phase", "uneven_forward"):
        assert all(c["lengths"] == [1] * gw.SAMPLES and not any(c["truncated"]) for c in short[mode]["completions"])
        assert all(c["lengths"] == [gw.LONG] * gw.SAMPLES and all(c["truncated"]) for c in long[mode]["completions"])
    calls = len(short["prompts"])
    assert short["uneven_phase"]["stats"]["calls"] == 3 * calls and long["uneven_phase"]["stats"]["calls"] == calls
    assert short["uneven_phase"]["stats"]["forwards"] == 3 * calls  # rank 0 never stepped with rank 1
    assert long["uneven_phase"]["stats"]["forwards"] == calls * gw.LONG
    lockstep = [r["uneven_forward"]["stats"]["forwards"] for r in ranks]
    if sharded:  # rank 0 kept stepping until rank 1 was done (synced_gpus)
        assert lockstep == [gw.LONG, gw.LONG], lockstep
    else:  # nothing gathered: no lockstep needed
        assert lockstep == [1, gw.LONG], lockstep
