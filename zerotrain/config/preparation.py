"""The settings of the two ways a run prepares its model (zerotrain/model/preparation.py): LoRA adapters and
quantization-aware training, resolved from the run config. Plain data: imports neither torch nor peft nor torchao,
and nothing of zerotrain, so zerotrain/model/lora.py and zerotrain/model/quant.py can name them without importing the
preparation that imports them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoraPlan:
    """LoRA adapters (HF peft) on a frozen base: the lora section, with what peft needs from the run."""

    r: int
    """Rank of every adapter (> 0)."""
    alpha: float
    """Scaling numerator: the update is scaled by alpha / r."""
    dropout: float
    """Dropout on the adapters' input."""
    targets: str
    """'all-linear' or a comma list of module names (lora.target_names)."""
    merge: bool
    """save_hf also writes final/merged/: the base with the adapter merged in."""
    peft_task_type: str
    """peft's TaskType member of the run's task (tasks.TaskSpec.peft_task_type: CAUSAL_LM, SEQ_CLS; SEQ_CLS trains
    and saves the fresh head whole)."""
    seed: int
    """run.seed: lora.apply_lora seeds torch with it + lora.SEED_OFFSET before peft creates the adapters,
    so every rank (and the one-process reference) creates the same ones."""
    gradient_checkpointing: bool
    """Checkpointed blocks behind the frozen embeddings: the embeddings' outputs are made to require grad."""
    scope: str | None = None
    """Image-text models: 'language' or 'all' (lora.scope); None (not set): language. A text-only model refuses it
    set (zerotrain/model/lora.py scope_exclude)."""
    frozen: tuple[str, ...] = ()
    """Image-text roles --freeze names: no adapters there either."""


@dataclass(frozen=True)
class QatPlan:
    """Quantization-aware training (torchao fake-quantized Linears): the scheme the model will be served in."""

    scheme: str
    """One of quant.QAT_SCHEMES."""
    group_size: int
    """int4 schemes: weights per quantization group along each Linear's input dimension."""

    def record(self) -> dict[str, Any]:
        """What a checkpoint records (meta extra "quant") and export --quantize converts with."""
        return {"scheme": self.scheme, "group_size": self.group_size}
