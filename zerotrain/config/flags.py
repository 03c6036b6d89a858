"""The run-config flags of `train`, `config`, `estimate` and `compare`, generated from RunConfig's fields.

A new config field gets its flag, its type and its help (the field's docstring) with no second list
to keep in step; a field whose flag does not follow the naming rule says so in its own metadata
(config.py, `json_schema_extra={"flag": ...}`).
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import dataclass
from types import UnionType
from typing import Any, Iterable, Literal, Optional, Union, get_args, get_origin

from pydantic.fields import FieldInfo

from ..errors import UserError
from .load import build_config
from .rules import check_config
from .schema import RunConfig, field_paths


def _field(dotted: str) -> FieldInfo:
    """The FieldInfo of a dotted config key."""
    model_cls, info = RunConfig, None
    for part in dotted.split("."):
        info = model_cls.model_fields[part]
        model_cls = info.annotation
    return info


@dataclass(frozen=True)
class RunFlag:
    """One CLI flag generated from a RunConfig leaf field."""

    flag: str
    dotted: str
    """The config key it sets ('zero.stage')."""
    kwargs: dict[str, Any]
    """argparse add_argument keywords (dest, type or action, default None, help)."""


def _unwrap(ann: Any) -> Any:
    """X for Optional[X]."""
    args = [a for a in get_args(ann) if a is not type(None)]
    return args[0] if get_origin(ann) in (Union, UnionType) and len(args) == 1 else ann


def _value_kwargs(dotted: str, info: FieldInfo) -> Optional[dict[str, Any]]:
    """argparse keywords for the field's type; None for a dict (set by --ds-override, not a flag)."""
    ann = _unwrap(info.annotation)
    origin, args = get_origin(ann), get_args(ann)
    if origin is Literal:
        return {"type": type(args[0]), "choices": list(args)}
    if ann is bool:  # a default-off switch stays a bare switch; the others get their --no- twin
        return {"action": "store_const", "const": True} if info.default is False else \
            {"action": argparse.BooleanOptionalAction}
    if origin is tuple and len(set(args)) == 1:
        return {"type": args[0], "nargs": len(args)}
    if ann in (int, float, str):
        return {"type": ann}
    if origin is dict:
        return None
    raise TypeError(f"config field {dotted}: no CLI flag for type {ann}; teach run_flags._value_kwargs about it")


def _flag_name(dotted: str, info: FieldInfo, ambiguous: set[str]) -> str:
    """The field's own "flag" metadata, else --<leaf>, section-prefixed when another section has that leaf."""
    named = (info.json_schema_extra or {}).get("flag")
    if named:
        return named
    *section, leaf = dotted.split(".")
    return "--" + "-".join([*section, leaf] if leaf in ambiguous else [leaf]).replace("_", "-")


def _shown(value: Any) -> str:
    """A default as it is typed on the command line or in YAML."""
    if isinstance(value, bool):
        return str(value).lower()
    return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)


def run_flags(skip: Iterable[str] = ()) -> list[RunFlag]:
    """One flag per leaf field of RunConfig, except the dotted keys in skip (a command's own flags)."""
    paths = field_paths()
    leaves = Counter(p.rsplit(".", 1)[-1] for p in paths)
    ambiguous = {leaf for leaf, n in leaves.items() if n > 1}
    skipped, flags = set(skip), []
    for dotted in [p for p in paths if p not in skipped]:
        info = _field(dotted)
        kw = _value_kwargs(dotted, info)
        if kw is None:
            continue
        flag, extra = _flag_name(dotted, info, ambiguous), info.json_schema_extra or {}
        if "flag_const" in extra:  # e.g. a bare --resume means 'latest'
            kw.update(nargs="?", const=extra["flag_const"])
        if "type" in kw and "choices" not in kw:
            kw["metavar"] = extra.get("metavar") or flag[2:].upper().replace("-", "_")
        default = "" if info.default is None else f", default: {_shown(info.default)}"
        kw.update(dest="cfg__" + dotted.replace(".", "__"), default=None,
                  help=f"{info.description} [{dotted}{default}]".replace("%", "%%"))
        flags.append(RunFlag(flag, dotted, kw))
    return flags


def add_run_flags(p: argparse.ArgumentParser, skip: Iterable[str] = ()) -> None:
    """The run-config flags (generated from RunConfig's fields), all defaulting to None (= not given).

    skip: dotted keys a command sets itself (estimate/compare sweep zero.stage, for instance)."""
    g = p.add_argument_group("run config (each also settable in the YAML --config file)")
    g.add_argument("--config", dest="config_file", metavar="RUN.yaml", help="YAML run config; flags override it")
    for f in run_flags(skip):
        g.add_argument(f.flag, **f.kwargs)
    g.add_argument("--ds-override", dest="ds_override", action="append", default=[], metavar="KEY=JSON",
                   help="raw DeepSpeed key merged last, e.g. zero_optimization.sub_group_size=1e8 [ds_overrides]")


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """{dotted key: value} of the run-config flags that were given."""
    return {key[5:].replace("__", "."): value for key, value in vars(args).items()
            if key.startswith("cfg__") and value is not None}


def config_from_args(args: argparse.Namespace, extra: Optional[dict[str, Any]] = None) -> RunConfig:
    """RunConfig from --config YAML plus the flags that were given; extra (dotted keys) wins over both."""
    cfg = build_config(getattr(args, "config_file", None), {**overrides_from_args(args), **(extra or {})})
    for item in getattr(args, "ds_override", []) or []:
        key, sep, raw = item.partition("=")
        if not sep:
            raise UserError(f"--ds-override {item!r}: expected KEY=JSON, e.g. zero_optimization.sub_group_size=1e8")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        tree = cfg.ds_overrides
        *parents, leaf = key.split(".")
        for k in parents:
            tree = tree.setdefault(k, {})
        tree[leaf] = value
    if cfg.ds_overrides:
        cfg.ds_overrides = cfg.ds_overrides  # assigned, so the config knows it was set (rules.unused_settings)
        check_config(cfg)
    return cfg
