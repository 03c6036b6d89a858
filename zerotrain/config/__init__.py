"""Run configuration: the typed schema (schema.py), the rules a config must satisfy on its own (rules.py) and
the command-line flags that set it (flags.py). `from zerotrain.config import build_config` is the documented
entry point (README.md)."""
from .schema import RunConfig, build_config  # noqa: F401
