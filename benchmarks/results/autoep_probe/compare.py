"""Compare AutoEP 2-rank losses with the plain 1-process reference (rel tol 1e-5)."""
import glob, json, re, sys
rows = []
for f in sorted(glob.glob("*_s[0-3]_*.json")):
    r = json.load(open(f))
    ref = json.load(open(f"ref_{r['model']}.json"))
    if not r.get("ok"):
        rows.append(f"{f}: FAIL {r['error']}")
        continue
    a = r["losses"] + [r["eval_loss_after"]]
    b = ref["losses"] + [ref["eval_loss_after"]]
    rel = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    # per-rank owned experts are in the log (rank 1 does not write json)
    import os
    logf = f.replace(".json", ".log")
    log = open(logf).read() if os.path.exists(logf) else json.dumps(r)  # rank 1 info only in the log
    owned = re.findall(r'"rank": (\d), .*?"local_expert_numel": (\d+), "full_expert_numel": (\d+)(?:, "owned_global_experts": (\{[^}]*\}))?', log)
    own = "; ".join(f"r{o[0]}: {o[1]}/{o[2]} {o[3] or ''}" for o in owned)
    rows.append(f"{f}: losses={['%.7f' % x for x in r['losses']]} eval_after={r['eval_loss_after']:.7f} "
                f"ref={['%.7f' % x for x in b]} max_rel={rel:.2e} {'PASS' if rel <= 1e-5 else 'FAIL'} | {own}")
print("\n".join(rows))
