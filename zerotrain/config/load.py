"""Build a RunConfig: defaults <- a YAML file (or a built config) <- dotted overrides (the CLI flags), validated
by the schema (zerotrain/config/schema.py) and then by the config's own rules (zerotrain/config/rules.py).
Every problem is one ConfigError line; an unknown key names the closest valid one."""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import ValidationError

from ..errors import ConfigError
from .rules import check_config
from .schema import RunConfig, field_paths


def _suggest(bad_path: str) -> str:
    """The valid key closest to a misspelt one, by full path and by last component."""
    paths = field_paths()
    sections = [p for p in RunConfig.model_fields]
    candidates = paths + sections
    best = difflib.get_close_matches(bad_path, candidates, n=1, cutoff=0.6)
    if not best:
        leaf = bad_path.rsplit(".", 1)[-1]
        by_leaf = {p.rsplit(".", 1)[-1]: p for p in paths}
        close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
        best = [by_leaf[close[0]]] if close else []
    return f"; did you mean '{best[0]}'?" if best else ""


def _one_line(err: ValidationError) -> str:
    e = err.errors()[0]
    path = ".".join(str(p) for p in e["loc"])
    if e["type"] == "extra_forbidden":
        return f"unknown config key '{path}'{_suggest(path)}"
    got = e.get("input")
    return f"config '{path}': {e['msg']} (got {got!r})"


def load_yaml(path: str | Path) -> dict:
    """Read a YAML run config into a nested dict, with one-line errors."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: file not found; pass an existing YAML run config")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"--config {path}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: the top level must be a mapping of sections (model:, zero:, ...)")
    return data


def set_path(tree: dict, dotted: str, value: Any) -> None:
    """Set tree['a']['b'] = value for dotted 'a.b', creating sections as needed."""
    keys = dotted.split(".")
    for k in keys[:-1]:
        tree = tree.setdefault(k, {})
        if not isinstance(tree, dict):
            raise ConfigError(f"config '{k}' must be a section (a mapping), not a value")
    tree[keys[-1]] = value


def build_config(yaml_path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                 base: Optional[RunConfig] = None) -> RunConfig:
    """Defaults <- YAML file (or `base`, an already built config) <- dotted overrides (CLI flags), validated.

    Raises ConfigError with one line on any problem.
    """
    assert yaml_path is None or base is None, "build_config: a YAML file or a base config, not both"
    tree: dict = load_yaml(yaml_path) if yaml_path else base.model_dump(mode="json", by_alias=True) if base else {}
    for dotted, value in (overrides or {}).items():
        set_path(tree, dotted, value)
    try:
        cfg = RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_one_line(e)) from None
    check_config(cfg)
    return cfg


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (what run_config.yaml holds); loads back with build_config."""
    return yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False)
