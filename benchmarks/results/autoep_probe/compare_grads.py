"""Step-1 gradient check: DS AutoEP stage 0 (2 ranks, gloo) vs plain reference. usage: compare_grads.py PREFIX"""
import sys, torch
pre = sys.argv[1]
ref = torch.load(f"{pre}.ref.pt")
ds = [torch.load(f"{pre}.rank{r}.pt") for r in range(2)]
worst = (0.0, "")
for name, g in ref.items():
    if "experts.gate_up_proj" in name or "experts.down_proj" in name:
        layer = name.split("layers.")[1].split(".")[0]
        base = f"m.model.layers.{layer}.mlp.experts."
        I = g.shape[1] // 2 if "gate_up" in name else None
        parts = []
        for r in range(2):
            if I:
                parts.append(torch.cat([ds[r][base + "w1"], ds[r][base + "w3"]], dim=1))
            else:
                parts.append(ds[r][base + "w2"])
        d = torch.cat(parts, 0)
    else:
        dsname = "m." + name.replace("mlp.gate.weight", "mlp.router.gate.weight")
        d = ds[0][dsname]
        assert torch.equal(ds[0][dsname], ds[1][dsname]), f"dense grad differs across ranks: {dsname}"
    rel = ((d - g).norm() / g.norm().clamp_min(1e-30)).item()
    worst = max(worst, (rel, name))
print(f"compared {len(ref)} params; worst relative L2 grad error {worst[0]:.2e} at {worst[1]}")
