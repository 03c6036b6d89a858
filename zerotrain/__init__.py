"""zerotrain: DeepSpeed ZeRO training for HuggingFace models, with an FSDP2 fallback."""

__version__ = "0.1.0"


def _mute_import_noise() -> None:
    """transformers imports torchao whenever it is installed (its quantizer registry), and torchao's import
    logs a warning per GPU kernel library that does not load on a CPU machine, and torch a deprecation note
    per enum torchao registers: lines on every run that say nothing about it. Only those records are dropped
    (torchao's only on a CPU build of torch, where its CUDA kernels cannot load)."""
    import logging
    import sys

    def drop(logger: str, needle: str, when=lambda: True) -> None:
        logging.getLogger(logger).addFilter(lambda record: needle not in record.getMessage() or not when())

    def cpu_torch() -> bool:
        torch = sys.modules.get("torch")
        return torch is not None and getattr(torch.version, "cuda", None) is None

    drop("torchao", "Failed to load", cpu_torch)
    drop("torch.utils._pytree", "is an Enum subclass and is now natively supported by torch.compile")


_mute_import_noise()
