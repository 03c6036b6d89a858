"""AutoEP (DeepSpeed expert_parallel) CPU/gloo probe.

DeepSpeed run (2 ranks):
  timeout 180 torchrun --nproc_per_node 2 autoep_probe.py --mode ds --stage 1 --model mixtral --out r.json
Plain reference (1 process, no DeepSpeed, global batch = both ranks' rows):
  timeout 180 python autoep_probe.py --mode ref --model mixtral --out ref.json
Extra expert_parallel keys:  --ep '{"use_grouped_mm": false}'
User-side wrapper / custom-preset path:  --wrap 1
"""
import argparse
import json
import os
import sys
import traceback

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SEQ = 8
STEPS = 2
LR = 1e-3
WORLD = 2


def build_model(name):
    import transformers
    torch.manual_seed(1234)
    if name == "mixtral":
        cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                         num_experts_per_tok=2)
        cls = transformers.MixtralForCausalLM
    elif name == "qwen3":
        cfg = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                          decoder_sparse_step=1, mlp_only_layers=[])
        cls = transformers.Qwen3MoeForCausalLM
    else:
        raise ValueError(name)
    cfg._attn_implementation = "eager"
    model = cls(cfg).float()
    model.train()
    return model


class Wrapper(torch.nn.Module):
    """User-side wrapper with no `.config`: AutoEP cannot see the HF model_type, so it takes the
    "custom" preset path (moe_layer_pattern from the DS config, adapter "default") instead of the
    Mixtral/Qwen3 preset adapter that retargets transformers' output recorders."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, **kw):
        return self.m(**kw)


def batches():
    """Global batch per step: [WORLD, SEQ]; rank r trains on row r."""
    g = torch.Generator().manual_seed(99)
    return [torch.randint(0, 128, (WORLD, SEQ), generator=g) for _ in range(STEPS + 1)]  # last: eval only


def expert_numel(model):
    return sum(p.numel() for n, p in model.named_parameters() if ".experts." in n or n.endswith(".experts"))


def expert_names(model):
    return [(n, tuple(p.shape)) for n, p in model.named_parameters() if ".experts." in n]


def original_gate_halves(model):
    """{layer_idx: [E, I, H] gate half of HF fused gate_up_proj} before AutoEP replaces it."""
    out = {}
    for n, p in model.named_parameters():
        if n.endswith("mlp.experts.gate_up_proj"):
            layer = int(n.split("layers.")[1].split(".")[0])
            out[layer] = p.detach().clone()[:, :p.shape[1] // 2, :]
    return out


def owned_global_experts(module, orig):
    """Which original (global) experts each rank's local w1 rows equal, per layer."""
    owned = {}
    for n, p in module.named_parameters():
        if n.endswith("mlp.experts.w1") and p.numel() > 0 and p.dim() == 3:
            layer = int(n.split("layers.")[1].split(".")[0])
            owned[layer] = [[g for g in range(orig[layer].shape[0]) if torch.equal(p[e].detach(), orig[layer][g])]
                            for e in range(p.shape[0])]
    return owned


def run_ref(args):
    model = build_model(args.model)
    full_expert = expert_numel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses = []
    *train, ev = batches()
    for ids in train:
        if args.ref_split:  # same math, but one row per forward like each DS rank (isolates batching noise)
            loss = sum(model(input_ids=ids[r:r + 1], labels=ids[r:r + 1]).loss for r in range(WORLD)) / WORLD
        else:
            # HF loss over the global batch = mean over all (equal-length) rows = mean of per-row losses.
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if args.dump_grads and not losses:
            torch.save({n: p.grad.detach().clone() for n, p in model.named_parameters()}, f"{args.dump_grads}.ref.pt")
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    with torch.no_grad():
        eval_loss = model(input_ids=ev, labels=ev).loss.item()  # after both updates
    res = {"mode": "ref", "model": args.model, "losses": losses, "eval_loss_after": eval_loss,
           "full_expert_numel": full_expert}
    print(json.dumps(res))
    if args.out:
        json.dump(res, open(args.out, "w"), indent=1)


def run_ds(args):
    import deepspeed
    import deepspeed.comm as dist
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    model = build_model(args.model)
    full_expert = expert_numel(model)
    orig = original_gate_halves(model)
    ep = {"enabled": True, "autoep_size": 2}
    if args.wrap:
        model = Wrapper(model)
        ep.update({"moe_layer_pattern": r"m\.model\.layers\.\d+\.mlp", "top_k": 2,
                   "route_norm": args.model == "mixtral"})  # Qwen3MoeConfig.norm_topk_prob defaults to False
    ep.update(json.loads(args.ep))
    opt_params = {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    if args.torch_adam:
        opt_params["torch_adam"] = True
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": opt_params},
        "zero_optimization": {"stage": args.stage},
        "expert_parallel": ep,
        "steps_per_print": 1000,
    }
    res = {"mode": "ds", "model": args.model, "stage": args.stage, "wrap": args.wrap, "config": cfg, "rank": rank}
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        res["expert_params"] = expert_names(engine.module)
        if args.stage == 3:
            local = sum(p.ds_numel for n, p in engine.module.named_parameters() if ".experts." in n)
        else:
            local = expert_numel(engine.module)
        res["local_expert_numel"] = local
        res["full_expert_numel"] = full_expert
        if args.stage != 3:
            res["owned_global_experts"] = owned_global_experts(engine.module, orig)
        res["module_types"] = sorted({type(m).__name__ for m in engine.module.modules() if "EP" in type(m).__name__
                                      or "Expert" in type(m).__name__})
        losses = []
        *train, ev = batches()
        for ids in train:
            my = ids[rank:rank + 1]
            loss = engine(input_ids=my, labels=my).loss
            engine.backward(loss)
            if args.dump_grads and not losses and args.stage == 0:
                torch.save({n: p.grad.detach().clone() for n, p in engine.module.named_parameters()
                            if p.grad is not None}, f"{args.dump_grads}.rank{rank}.pt")
            engine.step()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item() / dist.get_world_size())
        res["losses"] = losses
        engine.eval()
        with torch.no_grad():
            t = engine(input_ids=ev[rank:rank + 1], labels=ev[rank:rank + 1]).loss.detach().clone()
        dist.all_reduce(t)
        res["eval_loss_after"] = t.item() / dist.get_world_size()
        res["ok"] = True
        if args.save:
            engine.save_checkpoint(args.save, tag="probe")
            res["saved"] = sorted(os.listdir(os.path.join(args.save, "probe")))
    except Exception as e:
        res["ok"] = False
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        print(f"[rank{rank}] FAILED:\n" + res["traceback"], file=sys.stderr, flush=True)
    print(f"[rank{rank}] " + json.dumps({k: v for k, v in res.items() if k not in ("traceback", "config")}),
          flush=True)
    if args.out and rank == 0:
        json.dump(res, open(args.out, "w"), indent=1)
    if not res["ok"]:
        os._exit(1)  # avoid hanging in collective teardown after a one-sided failure


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ds", "ref"], default="ds")
    ap.add_argument("--model", choices=["mixtral", "qwen3"], default="mixtral")
    ap.add_argument("--stage", type=int, default=0)
    ap.add_argument("--ep", default="{}", help="extra expert_parallel keys as JSON")
    ap.add_argument("--torch-adam", type=int, default=1)
    ap.add_argument("--wrap", type=int, default=0, help="1: wrap model (no .config) and use moe_layer_pattern")
    ap.add_argument("--ref-split", type=int, default=0)
    ap.add_argument("--dump-grads", default="", help="prefix: save step-1 grads (ref, or DS stage 0)")
    ap.add_argument("--save", default="")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    run_ref(a) if a.mode == "ref" else run_ds(a)
