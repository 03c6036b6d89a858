"""Run configuration: the typed schema (schema.py), building one from YAML and overrides (load.py), the rules a
config must satisfy on its own (rules.py) and the command-line flags that set it (flags.py). `from zerotrain.config import build_config` is the documented
entry point (README.md)."""
from .load import build_config  # noqa: F401
from .schema import RunConfig  # noqa: F401
