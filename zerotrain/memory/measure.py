"""Per-rank memory a run really holds: model-state bytes counted from the engine's tensors.

`measure_model_state_bytes(engine)` walks the tensors the engine and its optimizer hold and counts
every storage once (key: device + untyped_storage().data_ptr()). tracemalloc does not see torch
tensors and, on CPU, DeepSpeed's memory_allocated() is process RSS, so this walk is the only honest
model-state figure; peak RSS (VmHWM, zerotrain/util.py) is a second, coarser figure. The
predictions these are compared with are in zerotrain/memory/estimate.py.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterator, Optional

import torch

from ..backends.base import Engine
from ..errors import UserError
from ..util import peak_rss_bytes
from .estimate import CATEGORIES

# Attribute-name hints that place a tensor found on a DeepSpeed optimizer into a category;
# the first hint that matches wins, anything else is a communication/staging buffer.
_NAME_HINTS: tuple[tuple[str, str], ...] = (
    ("fp32", "master"),
    ("single_partition", "master"),
    ("master", "master"),
    ("grad", "grads"),
    ("bit16", "params"),
    ("fp16", "params"),
    ("lp_param", "params"),
)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a DTensor (FSDP2 shard), else the tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _storage_key(t: torch.Tensor) -> Optional[tuple[str, int, int]]:
    """(device, data_ptr, nbytes) of a tensor's storage, None for meta/empty/freed storages."""
    t = _local(t)
    if t.device.type == "meta":
        return None
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    nbytes = st.nbytes()
    if nbytes == 0:  # FSDP2 frees unsharded params with resize_(0); ZeRO-3 params are numel-0 stubs
        return None
    return str(t.device), st.data_ptr(), nbytes


class _Counter:
    """Storage-deduplicated byte counts per category and device."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()
        self.by_cat: dict[str, int] = {c: 0 for c in CATEGORIES}
        self.by_device: dict[str, int] = {}
        self.by_source: dict[str, int] = {}

    def add(self, t: Any, cat: str, source: str = "") -> None:
        if not isinstance(t, torch.Tensor):
            return
        key = _storage_key(t)
        if key is None or key[:2] in self.seen:
            return
        self.seen.add(key[:2])
        self.by_cat[cat] += key[2]
        self.by_device[key[0]] = self.by_device.get(key[0], 0) + key[2]
        src = f"{cat}:{source}" if source else cat
        self.by_source[src] = self.by_source.get(src, 0) + key[2]


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors inside nested lists/tuples/dicts/dataclass-like bucket objects (bounded depth)."""
    if depth > 4:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from _tensors(v, depth + 1)
    elif type(obj).__module__.startswith("deepspeed") and hasattr(obj, "__dict__") \
            and not isinstance(obj, torch.nn.Module) and depth < 3:
        for v in vars(obj).values():  # e.g. IPGBucket.buffer
            yield from _tensors(v, depth + 1)


def _unwrap(engine: Any) -> tuple[torch.nn.Module, Any]:
    """(model, optimizer) from a raw DeepSpeedEngine or anything with module/optimizer attributes
    (benchmarks measure other tools' engines; a zerotrain Engine names its own: state_holders)."""
    seen: set[int] = set()
    obj = engine
    model, opt = None, None
    # Follow .engine/.ds_engine/.module wrappers down to the HF model; take the first optimizer seen.
    for _ in range(6):
        if id(obj) in seen or obj is None:
            break
        seen.add(id(obj))
        if opt is None:
            for name in ("optimizer", "_optimizer", "optim"):
                try:
                    cand = getattr(obj, name, None)
                except Exception:  # a property that needs state the engine does not have yet
                    cand = None
                if cand is not None and hasattr(cand, "param_groups"):
                    opt = cand
                    break
        nxt = None
        for name in ("ds_engine", "engine", "_engine", "module", "model", "_model"):
            cand = getattr(obj, name, None)
            if isinstance(cand, torch.nn.Module) or (cand is not None and hasattr(cand, "module")):
                nxt = cand
                break
        if isinstance(obj, torch.nn.Module):
            model = obj
        if nxt is None or nxt is obj:
            break
        if model is not None and isinstance(nxt, torch.nn.Module) and \
                len(list(nxt.parameters())) < len(list(model.parameters())):
            break  # a submodule, not a wrapper: LlamaForCausalLM.model is the body without lm_head
        obj = nxt
    if model is None:
        raise UserError(f"measure_model_state_bytes: cannot find a torch module in {type(engine).__name__}")
    return model, opt


def _inner_optimizer(opt: Any) -> Any:
    """The torch/DeepSpeed optimizer that owns `.state` (ZeRO wrappers keep it in `.optimizer`)."""
    inner = opt
    for _ in range(3):
        nxt = getattr(inner, "optimizer", None)
        if nxt is None or nxt is inner or not hasattr(nxt, "param_groups"):
            break
        inner = nxt
    return inner


def _fsdp_params(model: torch.nn.Module) -> Iterator[Any]:
    """FSDP2's FSDPParam objects (one per parameter) of every fully_shard'ed module."""
    for m in model.modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        if get_state is None:
            continue
        try:
            group = get_state()._fsdp_param_group
        except Exception:  # not an FSDP root/child with params
            continue
        yield from (getattr(group, "fsdp_params", []) if group is not None else [])


def measure_model_state_bytes(engine: Any) -> dict[str, Any]:
    """Bytes of model state this rank holds now, each storage counted once.

    Returns {params, grads, optimizer_states, master, buffers, total, device: {dev: bytes},
    sources: {category:attribute: bytes}}.
    Call it after the backward of an accumulation boundary and before its optimizer step, after at
    least one step (Adam creates its state lazily): that is when gradients and optimizer states
    coexist, i.e. the model-state peak the formulas predict.
    """
    model, opt = engine.state_holders() if isinstance(engine, Engine) else _unwrap(engine)
    c = _Counter()
    # 1. parameters as the module holds them; ZeRO-3 keeps the local partition in ds_tensor.
    params = list(model.parameters())
    fsdp = list(_fsdp_params(model))
    for fp in fsdp:  # the padded local shard (the DTensor's local tensor is a view of it)
        c.add(getattr(fp, "_sharded_param_data", None), "params", "fsdp_sharded")
    for p in params:
        c.add(p, "params", "module")
        c.add(getattr(p, "ds_tensor", None), "params", "ds_tensor")
    # 2. gradients on the parameters.
    for p in params:
        c.add(p.grad, "grads", "param.grad")
        c.add(getattr(getattr(p, "ds_tensor", None), "grad", None), "grads", "ds_tensor.grad")
    for fp in fsdp:  # without gradient sync FSDP2 accumulates unsharded grads here
        c.add(getattr(fp, "unsharded_accumulated_grad", None), "grads", "fsdp_unsharded_accumulated")
        c.add(getattr(getattr(fp, "_unsharded_param", None), "grad", None), "grads", "fsdp_unsharded")
    if opt is not None:
        inner = _inner_optimizer(opt)
        # 3. optimizer state (DTensor states count their local shard).
        for st in getattr(inner, "state", {}).values():
            for t in _tensors(st):
                c.add(t, "optimizer_states")
        # 4. what the inner optimizer updates: the master copy when it is not the module's params.
        for g in inner.param_groups:
            for p in g["params"]:
                c.add(p, "master", "inner_param_groups")
                c.add(p.grad, "grads", "inner_param_groups.grad")
        # 5. everything else the DeepSpeed wrapper holds, placed by attribute name.
        if opt is not inner or type(opt).__module__.startswith("deepspeed"):
            for name, value in sorted(vars(opt).items()):
                if name in ("optimizer", "param_groups", "state") or isinstance(value, torch.nn.Module):
                    continue
                lname = name.lower()
                cat = next((cat for hint, cat in _NAME_HINTS if hint in lname), "buffers")
                for t in _tensors(value):
                    c.add(t, cat, name)
                    c.add(t.grad, "grads", name + ".grad")
    for held in getattr(engine, "auxiliaries", {}).values():  # a preference run's reference model (Engine.auxiliary)
        frozen = held.model
        for fp in _fsdp_params(frozen):
            c.add(getattr(fp, "_sharded_param_data", None), "reference", "fsdp_sharded")
        for p in frozen.parameters():
            c.add(getattr(p, "ds_tensor", None), "reference", "ds_tensor")
            c.add(p, "reference", "module")
    out: dict[str, Any] = dict(c.by_cat)
    out["total"] = sum(c.by_cat.values())
    out["device"] = dict(c.by_device)
    out["sources"] = dict(c.by_source)
    return out


MODEL_STATE_ENV = "ZEROTRAIN_MODEL_STATE_DIR"
"""A directory named by whoever launches the run: trials.py (`zerotrain compare` and `tune` trials) sets it to
the trial's <output>/model_state. When set, record_model_state writes DIR/model_state_rank{R}.json once per
run and record_run_peak DIR/peak_rank{R}.json at the run's end."""


def record_model_state(engine: Engine) -> None:
    """Trainer hook: write this rank's measure_model_state_bytes to $ZEROTRAIN_MODEL_STATE_DIR, if set.

    The trainer calls it after the first backward of the last optimizer step (see
    measure_model_state_bytes for why then). No collectives: safe on any subset of ranks.
    """
    out = os.environ.get(MODEL_STATE_ENV)
    if not out:
        return
    rank = int(os.environ.get("RANK", "0"))
    rec = {"rank": rank, "measured": measure_model_state_bytes(engine), "peak_rss_bytes": peak_rss_bytes(),
           "global_step": engine.global_step, "micro_step": engine.micro_step}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"model_state_rank{rank}.json"), "w") as f:
        json.dump(rec, f, indent=1)


def record_run_peak(phase: str = "end") -> None:
    """Write this rank's whole-process peak RSS so far (VmHWM: loading, training, checkpoint and final
    saves) to $ZEROTRAIN_MODEL_STATE_DIR/peak_rank{R}.json, if set; `zerotrain train` calls it once the
    run is done. What `zerotrain tune` and `compare` hold a prediction against. No collectives."""
    out = os.environ.get(MODEL_STATE_ENV)
    if not out:
        return
    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"peak_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "phase": phase, "peak_rss_bytes": peak_rss_bytes()}, f)
