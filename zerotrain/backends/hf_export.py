"""The engine's HF export (Engine.save_hf): the trained model as a HF save_pretrained directory, from the live engine.

Every rank gathers (the backend's _full_state_dict, or under LoRA its _trainable_state_dict: the adapters alone);
rank 0 writes the directory aside and renames it into place when complete (errors.staged_dir), inside the backend's
_hf_write context (DeepSpeed switches its HF ZeRO-3 hook off there). Reading a checkpoint back offline is each
backend's checkpoint_io.py, not this.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ..checkpoint import store as ck
from ..distributed import process_group as dist
from ..distributed.agree import agree
from ..errors import EnvironmentFault, os_error_line, staged_dir
from ..model import lora, quant


def save_hf(engine: Any, out_dir: str | Path, tokenizer: Any = None, kept: str = "", fix: str = "") -> None:
    """Engine.save_hf: full consolidated weights (safetensors), or under LoRA peft's adapter files (+ merged/ with
    --merge-lora, lora.write_merged); with QAT also final/quantized-<scheme>/. An OS error on rank 0 (a full disk)
    ends every rank together (agree) as one line naming rank 0, the path, the OS's text, `kept` and `fix`."""
    out = Path(out_dir)
    adapter = engine.uses_lora
    state = engine._trainable_state_dict() if adapter else engine._full_state_dict()

    def write() -> None:
        if not engine.is_main:
            return
        with staged_dir(out) as tmp:
            if adapter:
                _write_adapter(engine, tmp, state, tokenizer)
            else:
                ck.write_hf_dir(tmp, engine.hf_model, state, tokenizer)
        state.clear()  # the gathered copy: freed before the conversion
        qat = engine.plan.preparation.qat
        if qat is not None and not adapter:  # final/quantized-<scheme>/ from the final/ just put in place (staged)
            quant.convert_qat_final(out, qat.scheme, qat.group_size)

    with engine._hf_write():  # also around the conversion: it loads the HF model again on rank 0 alone
        _write_agreed(write, out, engine.rank, kept, fix)
    state = None  # noqa: F841 - the gathered copy freed before the barrier
    dist.barrier()


def _write_adapter(engine: Any, tmp: Path, state: dict, tokenizer: Any) -> None:
    lora.write_adapter(tmp, engine.hf_model, state, tokenizer)
    if engine.plan.preparation.merge_lora:
        base = lora.load_base(lora.base_name(engine.hf_model), engine.plan.task, engine.hf_model.config)
        lora.write_merged(tmp / lora.MERGED_DIR, tmp, base, tokenizer)


def _write_agreed(write: Callable[[], None], out: Path, rank: int, kept: str, fix: str) -> None:
    """Rank 0's write of `out` under agree: an OS error becomes one EnvironmentFault line on rank 0 and every
    other rank stops with it, instead of waiting at the next barrier."""
    def guarded() -> None:
        try:
            write()
        except OSError as e:
            raise EnvironmentFault(os_error_line(e, rank, f"writing {out}", kept, fix)) from None

    agree(guarded, f"writing {out}")
