"""Mixture-of-experts models on real CPU ranks (the family matrix, tests/multirank/test_families.py, trains Mixtral,
Qwen3-MoE and DeepSeek-V3 at every engine configuration against one process, the router loss included; this file
holds what only MoE models have):
- routing that leaves experts without a token on a rank must finish, not hang, at ZeRO-3 (DeepSpeed with its
  defaults, with the sparse MoE block as leaf, with LoRA on the experts), FSDP2 stage 3 and under --ep 2, and still
  equal one process: 16 experts, top-1, a micro-batch of 8 tokens, so at least 8 experts receive nothing on every
  rank in every micro-batch (checked on the reference's own router);
- expert parallelism (--ep 2, FSDP2 stage 3): losses (LM + router loss) and grad norms equal one process with
  clipping active; each rank holds half of every expert tensor; the step's collectives (torch's flight recorder)
  hold the tokens' all-to-all and no collective of expert-sized tensors across ranks; final/ is an ordinary HF model
  with the trained weights; a checkpoint resumes exactly at ep 2 and resharded at ep 1; ep 2 x dp 2 on 4 ranks;
- the families whose router is a module named `router` (gpt-oss, Phi-MoE; found from their declarations,
  zerotrain/model/router.py): the router coefficient changes the loss as transformers' forward does (vs one process
  with output_router_logits and the same coefficient), --freeze-router keeps every router tensor, --ep 2 on FSDP2
  equals one process, and the expert load is in metrics.jsonl (a `zerotrain train` run).
"""
from __future__ import annotations

import json
import math

import pytest
import torch

import tests.support.families as families
import tests.support.reference as ref
from tests.support.launch import rank_env, ranks, torchrun
from tests.support.matrix import cells

pytestmark = pytest.mark.multirank

FP32_RTOL = 1e-5
SEQ, MICRO = 8, 1
"""Fewer tokens per micro-batch than experts (16): some expert gets none on every rank (pigeonhole)."""


@pytest.fixture(scope="module")
def sparse_moe(tmp_path_factory):
    return families.make_model_dir("qwen3-moe-top1", tmp_path_factory.mktemp("moe") / "qwen3-moe-top1")


def _idle_experts(model_dir, batches) -> list[int]:
    """Experts that get no token in each micro-batch of the reference, by the model's own router (block 0)."""
    model = families.builder(model_dir, "causal-lm")().eval()
    seen: list[int] = []
    block = model.model.layers[0].mlp
    hook = block.gate.register_forward_hook(lambda m, i, o: seen.append(
        int(model.config.num_experts - torch.unique(o[-1] if isinstance(o, tuple) else o.topk(1).indices).numel())))
    with torch.no_grad():
        for x in batches:
            model(input_ids=x)
    hook.remove()
    return seen


ZERO_TOKEN_CELLS = {
    "deepspeed": [],
    "fsdp": ["--backend", "fsdp"],
    "fsdp-ep2": ["--backend", "fsdp", "--ep", 2],  # 8 experts per rank: a rank's experts can all idle
    # the sparse MoE block as the ZeRO-3 leaf (DeepSpeed's fix for the hang): all its experts fetched together
    "deepspeed-moe-leaf": ["--ds-overrides", json.dumps({"zero_optimization": {"leaf_module": {
        "classes": ["Qwen3MoeSparseMoeBlock"]}}})],
    # LoRA (peft's all-linear) on the fused expert weights: each adapter spans every expert
    "deepspeed-lora": ["--lora-r", 4, "--lr", 1e-2, "--clip", 0.05],  # test_lora's lr and clip (its norms are small)
}
SLOW_ZERO_TOKEN = {"fsdp", "deepspeed-moe-leaf", "deepspeed-lora"}
"""CI: DeepSpeed ZeRO-3 and FSDP2 under --ep 2 (its experts split, which plain FSDP2 stage 3 does not)."""


@pytest.mark.parametrize("cell", cells(list(ZERO_TOKEN_CELLS), SLOW_ZERO_TOKEN))
def test_experts_without_tokens_finish_at_stage3_and_equal_one_process(sparse_moe, tmp_path, cell):
    data = ref.global_batches(ref.STEPS, ref.WORLD * ref.ACCUM * MICRO, SEQ)
    micro_batches = [x[r:r + MICRO] for x in data for r in range(0, x.shape[0], MICRO)]
    idle = _idle_experts(sparse_moe, micro_batches)
    assert idle and min(idle) >= 16 - SEQ * MICRO, idle  # the condition the test is about really occurs
    out = tmp_path / "run.json"
    ranks(ref.engine_worker_args(sparse_moe, out, "--stage", "3", "--micro", MICRO, "--seq", SEQ, "--timeout", 60,
                                 *ZERO_TOKEN_CELLS[cell]), timeout=300)  # a hang fails in 60 s, not never
    lora = cell.endswith("-lora")
    build = None
    if lora:
        from tests.multirank.test_lora import lora_build

        build = lora_build(sparse_moe, "causal-lm")
    clip = 0.05 if lora else ref.CLIP
    reference = ref.reference_run(sparse_moe, steps=ref.STEPS, world=ref.WORLD, grad_accum=ref.ACCUM, micro=MICRO,
                                  lr=1e-2 if lora else ref.LR, weight_decay=ref.WD, clip=clip, warmup=ref.WARMUP,
                                  seq_len=SEQ, build=build)
    if lora:  # the adapters on the experts really are there
        assert any(".experts." in n and "lora_" in n for n in reference["state_dict"]), "no adapter on the experts"
    ref.assert_parity(json.loads(out.read_text()), reference, FP32_RTOL, FP32_RTOL, f"qwen3-moe top-1 {cell} z3",
                      clip=clip)


# --- expert parallelism ----------------------------------------------------------------------------------------

EP_CLIP = 0.5
"""Below some step's gradient norm of every MoE family here, so clipping acts."""
EP_FAMILIES = ["mixtral", "qwen3-moe", "deepseek-v3"]
SLOW_EP = {"qwen3-moe"}
"""CI runs Mixtral and DeepSeek-V3 (shared experts, grouped routing) here, Qwen3-MoE on 4 ranks
(test_ep2_x_dp2_on_four_ranks_equals_one_process) and its ep2 resume through the CLI (tests/multirank/
test_cli_resume.py's ep2-fsdp); Qwen3-MoE's 2-rank cell is slow."""


class EpRuns:
    """Model dirs and the ep=2 runs (a checkpoint at step 3, final/, probe logits, the flight recorder's trace)."""

    def __init__(self, root):
        self.root, self.dirs, self.runs = root, {}, {}

    def model_dir(self, family: str):
        if family not in self.dirs:
            self.dirs[family] = families.make_model_dir(family, self.root / family / "model")
        return self.dirs[family]

    def run(self, family: str) -> dict:
        if family not in self.runs:
            w, out = self.root / family, self.root / family / "ep2.json"
            ranks(ref.engine_worker_args(self.model_dir(family), out, "--backend", "fsdp", "--stage", "3", "--ep", 2,
                                         "--clip", EP_CLIP, "--ckpt-root", w / "ck", "--save-at", 3,
                                         "--save-hf", w / "final", "--probe-out", w / "probe.pt",
                                         "--collectives-out", w / "collectives"),
                  timeout=400, env=rank_env(TORCH_FR_BUFFER_SIZE="100000"))
            self.runs[family] = json.loads(out.read_text())
        return self.runs[family]

    def reference(self, family: str) -> dict:
        return ref.reference_run(self.model_dir(family), steps=ref.STEPS, world=ref.WORLD, grad_accum=ref.ACCUM,
                                 micro=ref.MICRO, lr=ref.LR, weight_decay=ref.WD, clip=EP_CLIP, warmup=ref.WARMUP)


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory) -> EpRuns:
    return EpRuns(tmp_path_factory.mktemp("ep"))


@pytest.mark.parametrize("family", cells(EP_FAMILIES, SLOW_EP))
def test_ep2_equals_one_process_with_half_the_experts_per_rank(ep_runs, family):
    from transformers import AutoModelForCausalLM

    result, reference = ep_runs.run(family), ep_runs.reference(family)
    ref.assert_parity(result, reference, FP32_RTOL, FP32_RTOL, f"{family} fsdp z3 ep2", clip=EP_CLIP)
    assert "expert-parallel 2" in result["describe"][0], result["describe"]
    # every expert tensor split in two along the experts (the DTensor's local shard on each rank)
    split = {n: v for n, v in result["param_local"].items() if ".experts." in n}
    assert split and all(local * 2 == whole for local, whole in split.values()), split
    # final/: an ordinary HF model (the experts gathered from their ranks) with the trained weights and logits
    w = ep_runs.root / family
    model = AutoModelForCausalLM.from_pretrained(str(w / "final"), dtype=torch.float32).eval()
    state = model.state_dict()
    for k, v in reference["state_dict"].items():
        torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=k)
    with torch.no_grad():
        logits = model(input_ids=ref.probe_input()).logits
    torch.testing.assert_close(logits, torch.load(w / "probe.pt"), rtol=1e-5, atol=1e-5)


def test_ep2_moves_tokens_not_experts(ep_runs):
    """The flight recorder's collectives of the Mixtral ep=2 run: the tokens' all-to-all over the two ranks (at least
    dispatch and combine per MoE block, forward and backward, every micro-batch), and no all-gather, all-reduce or
    reduce-scatter across ranks of a tensor the size of one block's experts (half or whole): an "ep" that gathered
    the experts would pass the loss check but not this one. (The experts' FSDP unit is sharded over one rank.)"""
    result = ep_runs.run("mixtral")
    cfg = families.FAMILIES["mixtral"].config()
    half = sum(local for n, (local, _) in result["param_local"].items() if ".layers.0.mlp.experts." in n)
    expert_sizes = {half, 2 * half}
    for rank in range(ref.WORLD):
        trace = json.loads((ep_runs.root / "mixtral" / f"collectives.{rank}.json").read_text())
        across = [e for e in trace["entries"] if len(trace["groups"].get(e["group"], [])) > 1]
        to_all = [e for e in across if e["op"].endswith("all_to_all")]
        assert len(to_all) >= cfg.num_hidden_layers * 2 * 2 * ref.ACCUM * ref.STEPS, len(to_all)
        gathered = [e for e in across if any(k in e["op"] for k in ("all_gather", "all_reduce", "reduce_scatter"))]
        sizes = {math.prod(s) for e in gathered for s in e["in"] + e["out"]}
        assert gathered and not sizes & expert_sizes, (sorted(sizes), expert_sizes)


@pytest.mark.parametrize("ep", cells([2, 1], {"2"}))  # CI: at ep 1; at ep 2 exact (the CLI's ep2 resume is in CI)
def test_ep2_resumes_exactly_and_at_ep1(ep_runs, tmp_path, ep):
    """The step-3 checkpoint of the Mixtral ep=2 run resumed at ep=2 gives steps 4-6 exactly; at ep=1 (DCP reshards
    the experts onto every rank) the same within 1e-5."""
    straight, w = ep_runs.run("mixtral"), ep_runs.root / "mixtral"
    out = tmp_path / f"resume-ep{ep}.json"
    ranks(ref.engine_worker_args(ep_runs.model_dir("mixtral"), out, "--backend", "fsdp", "--stage", "3",
                                 "--ep", ep, "--clip", EP_CLIP, "--resume", w / "ck" / "global_step3"), timeout=400)
    resumed = json.loads(out.read_text())
    assert resumed["start_step"] == 3 and resumed["final_step"] == ref.STEPS
    d = ref.max_rel(ref.series(resumed, "loss", 3), ref.series(straight, "loss", 3))
    print(f"RESUME mixtral ep2 -> ep{ep}: loss max rel diff {d:.2e}")
    assert d <= (0.0 if ep == 2 else FP32_RTOL), (ep, d)


def test_ep2_x_dp2_on_four_ranks_equals_one_process(tmp_path):
    """Qwen3-MoE (8 experts) on 4 ranks at ep 2: two expert-parallel groups of 4 experts per rank, each expert held
    by two ranks and FSDP-sharded between them; every rank reads its own batch."""
    d = families.make_model_dir("qwen3-moe", tmp_path / "model")
    out = tmp_path / "run.json"
    ranks(ref.engine_worker_args(d, out, "--backend", "fsdp", "--stage", "3", "--ep", 2, "--clip", EP_CLIP),
          nproc=4, timeout=400)
    result = json.loads(out.read_text())
    reference = ref.reference_run(d, steps=ref.STEPS, world=4, grad_accum=ref.ACCUM, micro=ref.MICRO, lr=ref.LR,
                                  weight_decay=ref.WD, clip=EP_CLIP, warmup=ref.WARMUP)
    ref.assert_parity(result, reference, FP32_RTOL, FP32_RTOL, "qwen3-moe fsdp z3 ep2 x dp2", clip=EP_CLIP)
    assert "4 ranks = data-parallel 4 x expert-parallel 2" in result["describe"][0], result["describe"]
    split = {n: v for n, v in result["param_local"].items() if ".experts." in n}
    # rank 0's local shard: half the experts (ep), of which half the rows (FSDP over the 2 copies)
    assert split and all(local * 4 == whole for local, whole in split.values()), split


# --- families whose router is named `router` (gpt-oss, Phi-MoE) ---------------------------------------------------

ROUTER_COEF = 0.5
"""Far above the configs' 0.001: the router loss (about 2.0 here, 4 experts top-2) adds ~1.0 to every step's loss."""
ROUTER_CELLS = {  # cell: (family, engine flags)
    "gpt-oss-ds3": ("gpt-oss", ["--stage", "3"]),
    "phimoe-fsdp-ep2": ("phimoe", ["--backend", "fsdp", "--stage", "3", "--ep", 2]),
    "gpt-oss-fsdp-ep2": ("gpt-oss", ["--backend", "fsdp", "--stage", "3", "--ep", 2]),
    "phimoe-ds3": ("phimoe", ["--stage", "3"]),
}
SLOW_ROUTER = {"gpt-oss-fsdp-ep2", "phimoe-ds3"}
"""CI: gpt-oss on DeepSpeed ZeRO-3 and Phi-MoE on FSDP2 under --ep 2, each launch checking the coefficient, the frozen
routers and final/; the crossed pairs are slow."""


def _router_tensors(state: dict) -> dict:
    """The router tensors of a gpt-oss / Phi-MoE state dict by name (`...mlp.router.weight`, gpt-oss's `.bias`)."""
    return {k: v for k, v in state.items() if k.split(".")[-2] == "router"}


def _frozen_routers(build):
    def frozen():
        model = build()
        for name, p in model.named_parameters():
            if name.split(".")[-2] == "router":
                p.requires_grad_(False)
        return model
    return frozen


def _assert_same_steps(result: dict, reference: dict, label: str) -> None:
    """ref.assert_parity's loss, grad-norm and lr checks with clipping active, without its "the loss fell over the 6
    steps": on these random tokens the near-uniform gpt-oss and Phi-MoE do not (it rises by ~0.01 at 1e-3); that they
    train is shown by final/ equal to the reference's trained weights and unequal to the saved ones."""
    loss_d = ref.max_rel(ref.series(result, "loss"), reference["losses"])
    norm_d = ref.max_rel(ref.series(result, "grad_norm"), reference["grad_norms"])
    print(f"PARITY {label}: loss max rel diff {loss_d:.2e}, grad-norm max rel diff {norm_d:.2e}")
    torch.testing.assert_close(ref.series(result, "lr"), reference["lrs"], rtol=1e-12, atol=0)
    assert loss_d <= FP32_RTOL and norm_d <= FP32_RTOL, (label, loss_d, norm_d)
    assert max(reference["grad_norms"]) > EP_CLIP


@pytest.mark.parametrize("cell", cells(list(ROUTER_CELLS), SLOW_ROUTER))
def test_router_named_router_trains_its_loss_freezes_and_splits_as_one_process(tmp_path, cell):
    from transformers import AutoModelForCausalLM

    family, flags = ROUTER_CELLS[cell]
    d = families.make_model_dir(family, tmp_path / "model")
    out, final = tmp_path / "run.json", tmp_path / "final"
    ranks(ref.engine_worker_args(d, out, *flags, "--clip", EP_CLIP, "--router-aux-coef", ROUTER_COEF,
                                 "--freeze-router", "--save-hf", final, "--whole-step"), timeout=400)
    result = json.loads(out.read_text())
    run = dict(steps=ref.STEPS, world=ref.WORLD, grad_accum=ref.ACCUM, micro=ref.MICRO, lr=ref.LR, weight_decay=ref.WD,
               clip=EP_CLIP, warmup=ref.WARMUP, build=_frozen_routers(families.builder(d, "causal-lm")))
    reference = ref.reference_run(d, router_aux_coef=ROUTER_COEF, **run)
    _assert_same_steps(result, reference, f"{cell} router loss x {ROUTER_COEF}")
    # the coefficient trains: without it (transformers' forward without output_router_logits) every loss is ~1 lower
    plain = ref.reference_run(d, router_aux_coef=0.0, **run)
    added = [a - b for a, b in zip(ref.series(result, "loss"), plain["losses"])]
    print(f"ROUTER {cell}: loss at coef {ROUTER_COEF} {ref.series(result, 'loss')[0]:.4f}, at 0 "
          f"{plain['losses'][0]:.4f} (step 1)")
    assert all(0.9 < a < 1.1 for a in added), added  # 0.5 x the router loss (~2.0, 4 experts top-2)
    assert "mixture of experts: router load-balancing loss x 0.5" in " ".join(result["describe"]), result["describe"]
    if "--ep" in flags:
        split = {n: v for n, v in result["param_local"].items() if ".experts." in n}
        assert split and all(local * 2 == whole for local, whole in split.values()), split
    # --freeze-router: every router tensor (gpt-oss's biases too) as it was saved; the rest trained as one process
    initial = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).state_dict()  # Phi-MoE's file keys differ
    saved = _router_tensors(initial)
    trained = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).state_dict()
    assert len(saved) == (4 if family == "gpt-oss" else 2), sorted(saved)
    for k, v in saved.items():
        torch.testing.assert_close(trained[k], v, rtol=0, atol=0, msg=k)
    # atol 2e-5, 2% of one step's largest Adam update (lr 1e-3): Adam turns a summation-order difference of a
    # near-zero gradient (an embedding row few tokens hit) into a visible one; measured 1.2e-5 on an AVX-512 CPU
    # for gpt-oss at ZeRO-3, with losses equal to 1.5e-8
    for k, v in reference["state_dict"].items():
        torch.testing.assert_close(trained[k], v, rtol=1e-4, atol=2e-5, msg=k)
    moved = [k for k, v in initial.items() if k not in saved and not torch.equal(trained[k], v)]
    assert len(moved) >= len(trained) // 2, moved  # it trained (every tensor but the routers' and norms' may move)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt-oss", "phimoe"])
def test_router_named_router_logs_expert_load_in_metrics(tmp_path, family):
    """`zerotrain train` on a saved gpt-oss / Phi-MoE: metrics.jsonl holds every step's tokens per expert (each token's
    top-2 once per block, every rank's) and the router loss it trained with."""
    from zerotrain.assets.demo import build_tokenizer

    d = families.make_model_dir(family, tmp_path / "model")
    build_tokenizer().save_pretrained(str(d))  # the demo corpus's tokenizer (742 tokens < the model's 1024)
    o = tmp_path / "out"
    torchrun(["-m", "zerotrain", "train", "--model", str(d), "--seq-len", "32", "--pack", "--micro-batch", "2",
              "--grad-accum", "2", "--max-steps", "2", "--router-aux-coef", "0.5", "--dist-timeout", "120",
              "--output", str(o)], timeout=400)
    rows = [r for r in map(json.loads, (o / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(rows) == 2, rows
    for r in rows:
        assert r["loss"] == pytest.approx(r["lm_loss"] + 0.5 * r["router_aux_loss"], rel=1e-6)
        assert len(r["expert_tokens"]) == 4 and r["expert_imbalance"] >= 1.0
        assert sum(r["expert_tokens"]) == 2 * 2 * r["tokens"]  # 2 blocks x top-2, every token of every rank
