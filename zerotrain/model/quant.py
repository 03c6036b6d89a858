"""Quantization with torchao: the schemes, quantization-aware training (QAT) and quantized HF directories.

Every scheme is a torchao config applied with `quantize_` to a model's nn.Linear layers (the output head
stays in full precision, as transformers' torchao integration leaves it). A quantized model is written
with transformers' own torchao serializer, so `AutoModelForCausalLM.from_pretrained(OUT)` reloads it.
QAT swaps those Linears for torchao's FakeQuantizedLinear (same parameters, same state-dict keys), so
checkpoints and final/ stay ordinary full-precision models; converting a QAT model is the same
`quantize_` of the learned weights (tested equal to torchao's QAT convert step).
"""
from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..errors import UserError

QAT_FILE = "zerotrain_qat.json"
"""Written into a QAT run's final/: the scheme and group size that `zerotrain export --quantize` reuses."""

INSTALL = "pip install 'zerotrain[quant]' (torchao)"

@dataclass(frozen=True)
class Scheme:
    name: str
    summary: str
    """What the scheme is for, one line (README, --help)."""
    grouped: bool
    """Takes --quant-group-size (int4 weights, one scale and zero point per group)."""
    weight_bits: int
    activations: str
    """'fp32' (weight-only: dequantized for the matmul), 'int8-dynamic' (per-token scales at run time) or
    'int8-static' (per-tensor scales calibrated ahead of time)."""
    artifact: str = "hf"
    """'hf': a HF directory that from_pretrained reloads (torchao tensors in safetensors); 'program': a
    torch.export program next to the HF config (zerotrain/export/static_int8.py)."""


SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    Scheme("int8-weight", "int8 weights (per output channel), fp32 activations: half-precision-free size cut", False, 8, "fp32"),
    Scheme("int8-dynamic", "int8 weights and int8 activations quantized per token at run time: int8 matmuls", False, 8,
           "int8-dynamic"),
    Scheme("int8-static", "int8 weights and activations with scales calibrated ahead of time (--calibration-data), "
           "saved as a torch.export program for compiled CPU serving", False, 8, "int8-static", artifact="program"),
    Scheme("int4-weight", "int4 weights in groups, fp32 activations: the smallest weights; QAT recovers quality",
           True, 4, "fp32"),
    Scheme("int8-dynamic-int4-weight", "int4 weights in groups with int8 dynamic activations (ExecuTorch-style CPU serving)",
           True, 4, "int8-dynamic"),
)}
QAT_SCHEMES = ("int4-weight", "int8-dynamic-int4-weight")


def torchao_config(scheme: str, group_size: int):
    """The torchao config of a scheme. int4 weights use torchao's IntxWeightOnly layout (int4 values held
    unpacked in int8): the Int4WeightOnlyConfig layouts need GPU kernels (mslk, tinygemm) on this stack."""
    import_torchao()
    from torchao.quantization import (
        Int8DynamicActivationInt8WeightConfig,
        Int8DynamicActivationIntxWeightConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
    )
    from torchao.quantization.granularity import PerGroup

    if scheme == "int8-weight":
        return Int8WeightOnlyConfig()
    if scheme == "int8-dynamic":
        return Int8DynamicActivationInt8WeightConfig()
    if scheme == "int4-weight":
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))
    if scheme == "int8-dynamic-int4-weight":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group_size))
    if scheme == "int8-static":
        raise ValueError("int8-static is not a torchao config: it is PT2E's (zerotrain/export/static_int8.py)")
    raise UserError(f"--quantize {scheme}: unknown scheme; choose one of {', '.join(SCHEMES)}")


def embedding_config():
    """--quantize-embeddings, the input embedding: int8 weight-only, one scale per row (a lookup has no
    activation to quantize); torchao's IntxWeightOnlyConfig is the config that takes nn.Embedding."""
    import_torchao()
    from torchao.quantization import IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis

    return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))


def head_config():
    """--quantize-embeddings, the output head of the torchao schemes: int8 weight-only per output channel, the
    same treatment as the input embedding whatever the Linears' scheme (int8-static quantizes the head statically
    with its other Linears instead: zerotrain/export/static_int8.py)."""
    from torchao.quantization import Int8WeightOnlyConfig

    return Int8WeightOnlyConfig()


def import_torchao():
    """torchao, or one line with the install command (its import noise is muted in zerotrain/__init__.py)."""
    try:
        import torchao
        import torchao.quantization  # noqa: F401
        import torchao.quantization.qat  # noqa: F401
    except ImportError as e:
        raise UserError(f"quantization needs torchao ({e}); {INSTALL}") from None
    return torchao


def torchao_quantized(model: str) -> bool:
    """Whether `model` (a local directory or a hub id) was saved torchao-quantized (config.json's
    quantization_config); True when that cannot be told without downloading (a hub id not in the local cache)."""
    import json

    config = Path(model) / "config.json"
    adapter = Path(model) / "adapter_config.json"
    if adapter.is_file() and not config.is_file():  # a peft adapter: its base model is what loads
        try:
            base = json.loads(adapter.read_text()).get("base_model_name_or_path")
        except (OSError, ValueError):
            return True
        return torchao_quantized(base) if base else True
    if not Path(model).is_dir():
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(model, "config.json")
        except Exception:  # noqa: BLE001 - not a repo id either (a preset name, a typo): transformers decides later
            return True
        if not isinstance(cached, str):
            return True
        config = Path(cached)
    try:
        quant = json.loads(config.read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return not Path(model).is_dir()  # a directory without a config.json loads nothing quantized
    return quant.get("quant_method") == "torchao"


def transformers_without_torchao() -> bool:
    """Import transformers' model code with torchao hidden, for a process that never uses torchao (a run without
    QAT and without a torchao-quantized model: plan/resolve.py quantizes_nothing). transformers imports torchao at
    `import transformers.modeling_utils` whenever it is installed (its torchao quantizer): about 2 s per process
    here, in every rank of every run. Its torchao integration then counts torchao as absent in this process (only
    loading or writing a torchao-quantized model uses it); `import torchao` itself still works. Nothing is done where
    transformers' model code or torchao is imported already. True when transformers was imported so."""
    import sys

    if "torchao" in sys.modules or "transformers.modeling_utils" in sys.modules:
        return False
    sys.modules["torchao"] = None  # type: ignore[assignment]  (find_spec None: transformers' check says absent)
    try:
        import transformers.modeling_utils  # noqa: F401
    except ImportError:  # transformers had already found torchao: the caller's import brings it in as usual
        return False
    finally:
        if "torchao" in sys.modules and sys.modules["torchao"] is None:
            del sys.modules["torchao"]
    return True


# --- which layers ----------------------------------------------------------------------------------

def _head_ids(model: torch.nn.Module) -> set[int]:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return {id(head)} if head is not None else set()


def quantizable_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The Linear layers a scheme quantizes (FakeQuantizedLinear is a Linear): all but the output head."""
    heads = _head_ids(model)
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and id(m) not in heads}


def check_model(model: torch.nn.Module, scheme: str, group_size: int, flag: str) -> dict[str, torch.nn.Linear]:
    """Refuse, in one line, a model torchao would leave as it is, or a group size its layers cannot take."""
    from transformers.pytorch_utils import Conv1D

    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    if any(isinstance(m, Conv1D) for m in model.modules()):
        raise UserError(f"{flag} {scheme}: {model_type} keeps its projections in transformers' Conv1D, not nn.Linear, "
                        "and torchao quantizes only nn.Linear (it would leave every block as it is); quantize a model "
                        "with Linear projections (Llama, Qwen2, Mistral, ...)")
    linears = quantizable_linears(model)
    if not linears:
        raise UserError(f"{flag} {scheme}: {model_type} has no nn.Linear layer besides its output head to quantize")
    if SCHEMES[scheme].grouped:
        bad = {n: m.in_features for n, m in linears.items() if m.in_features % group_size}
        if bad:
            name, width = next(iter(bad.items()))
            g = math.gcd(*(m.in_features for m in linears.values()))
            fits = max(d for d in (256, 128, 64, 32, 16, 8, 4, 2, 1) if g % d == 0)
            raise UserError(f"--quant-group-size {group_size}: does not divide the input width {width} of {name} "
                            f"({len(bad)} layers); pass --quant-group-size {fits}")
    return linears


def _only(linears: dict[str, torch.nn.Linear]) -> Callable[[torch.nn.Module, str], bool]:
    """quantize_'s filter_fn for exactly these layers."""
    targets = {id(m) for m in linears.values()}
    return lambda module, fqn: id(module) in targets


# --- quantization-aware training -------------------------------------------------------------------

def qat_prepare(model: torch.nn.Module, scheme: str, group_size: int) -> torch.nn.Module:
    """Swap the model's Linears for torchao's FakeQuantizedLinear of the QAT scheme (in place). The
    swapped layers take over the existing Parameter objects (torchao's from_linear), so a model whose
    weights ZeRO-3 has already partitioned, or that lives on the meta device, keeps them as they are.
    Whether a run uses QAT, and which scheme, is its ModelPreparation's (zerotrain/model/preparation.py)."""
    import_torchao()
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    linears = check_model(model, scheme, group_size, "--qat")
    quantize_(model, QATConfig(torchao_config(scheme, group_size), step="prepare"), filter_fn=_only(linears))
    return model


def qat_convert(model: torch.nn.Module, scheme: str, group_size: int) -> torch.nn.Module:
    """torchao's QAT convert step: FakeQuantizedLinear back to Linear with quantized weights (in place)."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    quantize_(model, QATConfig(torchao_config(scheme, group_size), step="convert"),
              filter_fn=_only(quantizable_linears(model)))
    return model


def fake_quantized_layers(model: torch.nn.Module) -> int:
    from torchao.quantization.qat.linear import FakeQuantizedLinear

    return sum(isinstance(m, FakeQuantizedLinear) for m in model.modules())


def write_qat_marker(final_dir: Path, scheme: str, group_size: int) -> None:
    (Path(final_dir) / QAT_FILE).write_text(json.dumps({"scheme": scheme, "group_size": group_size}))


def read_qat_marker(model_dir: Path) -> Optional[dict[str, Any]]:
    path = Path(model_dir) / QAT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def convert_qat_final(final_dir: Path, scheme: str, group_size: int) -> Path:
    """A QAT run's final/ -> final/quantized-<scheme>/ (rank 0, after final/ is written), by `zerotrain
    export --quantize` (zerotrain/export/quantized.py) in a fresh process: a ZeRO-3 process has DeepSpeed's
    memory-efficient F.linear installed for its lifetime (zero.Init), which transposes weights with aten.t,
    an op torchao's int4 tensors lack."""
    import subprocess
    import sys

    write_qat_marker(final_dir, scheme, group_size)
    out = Path(final_dir) / f"quantized-{scheme}"
    # eager timing only: compiling both models for the report would add a minute per shape to the end of training
    cmd = [sys.executable, "-m", "zerotrain", "export", str(final_dir), str(out), "--quantize", scheme,
           "--quant-group-size", str(group_size), "--serve-timing", "eager"]
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if res.returncode != 0:
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        raise UserError(f"--qat {scheme}: converting {final_dir} failed ({lines[-1] if lines else res.returncode}); "
                        f"final/ is complete; retry with: {' '.join(cmd[1:]).replace('-m zerotrain', 'zerotrain')}")
    return out


# --- post-training quantization and the HF directory -----------------------------------------------

def untie_output_head(model: torch.nn.Module) -> None:
    """A head sharing the input embedding's weight gets its own copy, so each is quantized in its own scheme
    (what TorchAoConfig's untie_embedding_weights does on reload)."""
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and emb is not None and head.weight is emb.weight:
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        model.config.tie_word_embeddings = False


def _fqn_config(model: torch.nn.Module, scheme: str, group_size: int):
    """--quantize-embeddings: the scheme on the Linears, int8 weight-only on the input embedding and the head."""
    from torchao.quantization import FqnToConfig

    names = {id(m): n for n, m in model.named_modules()}
    return FqnToConfig({"_default": torchao_config(scheme, group_size),
                        names[id(model.get_input_embeddings())]: embedding_config(),
                        names[id(model.get_output_embeddings())]: head_config()})


def quantize_model(model: torch.nn.Module, scheme: str, group_size: int, flag: str = "--quantize",
                   embeddings: bool = False) -> int:
    """Quantize the model's Linears in place (with embeddings: the input embedding and the output head too, int8
    weight-only); returns how many Linear layers took the scheme."""
    import_torchao()
    from torchao.quantization import quantize_

    linears = check_model(model, scheme, group_size, flag)
    if embeddings:
        untie_output_head(model)
        # FqnToConfig takes no filter_fn: its "_default" covers every Linear (check_model's set and the head)
        quantize_(model, _fqn_config(model, scheme, group_size), filter_fn=None)
    else:
        quantize_(model, torchao_config(scheme, group_size), filter_fn=_only(linears))
    return len(linears)


def weight_scheme(weight: torch.Tensor) -> Optional[str]:
    """The scheme a quantized weight tensor belongs to, read off its torchao type (None: not quantized).
    int8-weight and int8-dynamic share Int8Tensor and differ in its activation-quantization kwargs; an int8
    IntxUnpackedToInt8Tensor is --quantize-embeddings' weight-only embedding."""
    kind = type(weight).__name__
    if kind == "Int8Tensor":
        return "int8-dynamic" if getattr(weight, "act_quant_kwargs", None) is not None else "int8-weight"
    if kind == "IntxUnpackedToInt8Tensor" and getattr(weight, "target_dtype", None) == torch.int4:
        return "int8-dynamic-int4-weight" if getattr(weight, "activation_quantization", None) else "int4-weight"
    if kind == "IntxUnpackedToInt8Tensor" and getattr(weight, "target_dtype", None) == torch.int8:
        return "int8-weight"
    return None


def layer_schemes(model: torch.nn.Module) -> dict[str, int]:
    """How many Linear layers below the output head hold weights of each scheme ('none': full precision)."""
    counts: dict[str, int] = {}
    for m in quantizable_linears(model).values():
        key = weight_scheme(m.weight) or "none"
        counts[key] = counts.get(key, 0) + 1
    return counts


def embedding_schemes(model: torch.nn.Module) -> dict[str, str]:
    """The scheme of the input embedding's and the output head's weights ('none': full precision)."""
    return {"input_embedding": weight_scheme(model.get_input_embeddings().weight) or "none",
            "output_head": weight_scheme(model.get_output_embeddings().weight) or "none"}


def save_quantized(model: torch.nn.Module, out_dir: Path, scheme: str, group_size: int, tokenizer: Any = None,
                   embeddings: bool = False) -> None:
    """save_pretrained through transformers' torchao serializer (safetensors + the tensor-subclass metadata)
    with the scheme recorded in config.json's quantization_config, so from_pretrained reloads it."""
    from transformers import TorchAoConfig
    from transformers.quantizers.quantizer_torchao import TorchAoHfQuantizer

    if embeddings:
        qcfg = TorchAoConfig(quant_type=_fqn_config(model, scheme, group_size), include_input_output_embeddings=True,
                             untie_embedding_weights=True)
    else:
        qcfg = TorchAoConfig(quant_type=torchao_config(scheme, group_size))
    model.config.quantization_config = qcfg
    model.hf_quantizer = TorchAoHfQuantizer(qcfg)  # what from_pretrained(quantization_config=...) attaches
    model.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def weights_bytes(model_dir: Path) -> int:
    """Bytes of a HF directory's weight files (safetensors / bin)."""
    return sum(f.stat().st_size for f in Path(model_dir).iterdir()
               if f.suffix in (".safetensors", ".bin") and f.is_file())


def replace_dir(tmp: Path, out: Path) -> None:
    """Move a finished directory into place (an earlier OUT is replaced only once the new one is whole)."""
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def serving_bytes(model: torch.nn.Module, group_size: int) -> dict[str, Optional[int]]:
    """Bytes of the model's weights on disk in fp32 and per scheme (the model may live on the meta device):
    quantized Linears hold 1 byte per weight (int4 values are stored unpacked in int8 on this stack) plus a
    fp32 scale per row (int8) or a fp32 scale and int8 zero point per group (int4); everything else stays
    fp32. None: the scheme cannot quantize this model (Conv1D projections, a group size that does not fit).
    int8-static: the tensors of its program; the serialized graph (~1.5 KB a node) comes on top."""
    full = 4 * sum(p.numel() for p in model.parameters())  # parameters() lists a tied weight once
    sizes: dict[str, Optional[int]] = {"fp32": full}
    for name, scheme in SCHEMES.items():
        try:
            linears = check_model(model, name, group_size, "--quantize")
        except UserError:
            sizes[name] = None
            continue
        saved = 0
        for m in linears.values():
            rows, cols = m.weight.shape
            meta = rows * (cols // group_size) * 5 if scheme.grouped else rows * 4
            saved += 4 * rows * cols - (rows * cols + meta)
        sizes[name] = full - saved
    return sizes
