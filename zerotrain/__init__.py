"""zerotrain: DeepSpeed ZeRO training for HuggingFace models, with an FSDP2 fallback."""

__version__ = "0.1.0"
