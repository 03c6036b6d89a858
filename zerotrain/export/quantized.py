"""`zerotrain export SRC OUT --quantize SCHEME`: a quantized HF directory and its quantization_report.json.

SRC is a HF model directory (a run's final/, its merged/ LoRA model), a checkpoint dir, a checkpoints/
root or a run output dir (exported to full precision first). The report holds what a user decides on:
bytes on disk against the full-precision source, eval loss / perplexity before and after (--eval-data,
same data pipeline as training), forward tokens/s before and after on this machine, and the largest
logit difference between the reloaded directory and the in-memory quantized model.
"""
from __future__ import annotations

import copy
import json
import math
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ..errors import UserError
from ..model import quant

REPORT_FILE = "quantization_report.json"


@dataclass(frozen=True)
class QuantizeRequest:
    scheme: str
    """One of quant.SCHEMES."""
    group_size: Optional[int] = None
    """int4 schemes; None: a QAT source's own group size, else RunConfig's default."""
    eval_data: Optional[str] = None
    """Text/chat data file for eval loss before and after (None: no perplexity in the report)."""
    seq_len: int = 128
    """Tokens per eval row (and per timed row)."""
    batch_size: int = 4
    """Rows per forward pass for eval and timing."""
    eval_batches: int = 32
    """At most this many eval batches."""


def resolve_source(src: Path, workdir: Path) -> tuple[Path, Optional[dict[str, Any]]]:
    """SRC -> (a full-precision HF model dir, the QAT marker if the run trained with --qat)."""
    from ..checkpoint import store as ck
    from .to_hf import export_checkpoint

    if not src.exists():
        raise UserError(f"export --quantize: {src} does not exist; pass a run's final/, a HF model dir or a checkpoint dir")
    if (src / "adapter_config.json").is_file():
        merged = src / "merged"
        if (merged / "config.json").is_file():
            return merged, quant.read_qat_marker(src)
        raise UserError(f"export --quantize: {src} holds a LoRA adapter, not a model; quantize its merged model "
                        f"(train with --merge-lora, or `zerotrain export CKPT OUT --merge-lora` first)")
    if (src / "config.json").is_file():
        return src, quant.read_qat_marker(src)
    path = ck.resolve_checkpoint(src)
    meta = ck.read_meta(path)
    if "lora" in meta.extra:
        raise UserError(f"export --quantize: {path} is a LoRA checkpoint; export it with --merge-lora first and "
                        "quantize OUT/merged")
    full = export_checkpoint(path, workdir / "full-precision")
    qat = meta.extra.get("quant")
    return Path(full), (qat if qat and qat.get("scheme", "none") != "none" else None)


def _eval_batches(req: QuantizeRequest, tokenizer) -> list[dict[str, torch.Tensor]]:
    from ..config.load import build_config
    from ..data.datasets import prepare_data

    cfg = build_config(overrides={"data.path": req.eval_data, "data.seq_len": req.seq_len, "data.eval_split": 0.0})
    data = prepare_data(cfg, tokenizer)
    rows = [data.train[i] for i in range(min(len(data.train), req.batch_size * req.eval_batches))]
    return [data.collate(rows[i:i + req.batch_size]) for i in range(0, len(rows), req.batch_size)]


@torch.no_grad()
def eval_loss(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> float:
    """Token-weighted mean next-token loss over the batches (labels -100 are not counted)."""
    total, count = 0.0, 0
    for b in batches:
        inputs = {k: v for k, v in b.items() if k in ("input_ids", "attention_mask", "labels", "position_ids")}
        n = int((inputs["labels"][:, 1:] != -100).sum())
        total += float(model(**inputs).loss) * n
        count += n
    return total / max(count, 1)


@torch.no_grad()
def forward_tokens_per_s(models: list[torch.nn.Module], ids: torch.Tensor, rounds: int = 5) -> list[float]:
    """Median tokens/s of a plain forward pass over ids for each model, timed in interleaved rounds (the
    machine's noise falls on every model alike); one warm-up pass each first."""
    for m in models:
        m(input_ids=ids)
    times: list[list[float]] = [[] for _ in models]
    for _ in range(rounds):
        for i, m in enumerate(models):
            t0 = time.perf_counter()
            m(input_ids=ids)
            times[i].append(time.perf_counter() - t0)
    return [ids.numel() / statistics.median(t) for t in times]


def _timing_ids(model: torch.nn.Module, req: QuantizeRequest) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, model.config.vocab_size, (req.batch_size, req.seq_len), generator=g)


def _load(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    except (ValueError, KeyError) as e:
        raise UserError(f"export --quantize: {model_dir} does not load as a causal LM ({e}); quantized export "
                        "is for decoder language models") from None
    model.eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer


def quantize_dir(src_dir: Path, out: Path, req: QuantizeRequest, group_size: int,
                 source_label: Optional[str] = None) -> dict[str, Any]:
    """Full-precision HF dir -> quantized HF dir at OUT (written whole, then moved into place) + report."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = _load(src_dir)
    quant.check_model(model, req.scheme, group_size, "--quantize")
    if req.eval_data and tokenizer is None:
        raise UserError(f"--eval-data: {src_dir} has no tokenizer to read the data with")
    batches = _eval_batches(req, tokenizer) if req.eval_data else []
    ids = _timing_ids(model, req)
    loss_before = eval_loss(model, batches) if batches else None
    full = copy.deepcopy(model)  # timed beside the quantized model
    layers = quant.quantize_model(model, req.scheme, group_size)
    with torch.no_grad():
        in_memory = model(input_ids=ids).logits
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        quant.save_quantized(model, tmp, req.scheme, group_size, tokenizer)
        del model
        reloaded = AutoModelForCausalLM.from_pretrained(tmp).eval()  # what a user's from_pretrained gets
        with torch.no_grad():
            logits_diff = float((reloaded(input_ids=ids).logits - in_memory).abs().max())
        speed = forward_tokens_per_s([full, reloaded], ids)
        before = {"eval_loss": loss_before, "forward_tokens_per_s": speed[0]}
        after = {"eval_loss": eval_loss(reloaded, batches) if batches else None, "forward_tokens_per_s": speed[1]}
        report = _report(req, group_size, src_dir, tmp, source_label, layers, quant.layer_schemes(reloaded),
                         before, after, logits_diff, len(batches))
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")
        quant.replace_dir(tmp, out)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def _report(req, group_size, src_dir, out_dir, source_label, layers, schemes, before, after, logits_diff,
            n_batches) -> dict[str, Any]:
    import torchao
    import transformers

    src_bytes, out_bytes = quant.weights_bytes(src_dir), quant.weights_bytes(out_dir)

    def ppl(loss):
        return math.exp(loss) if loss is not None else None

    return {
        "scheme": req.scheme, "group_size": group_size if quant.SCHEMES[req.scheme].grouped else None,
        "source": source_label or str(src_dir), "layers_quantized": layers, "layer_schemes": schemes,
        "bytes_source": src_bytes, "bytes_quantized": out_bytes, "size_ratio": out_bytes / src_bytes,
        "eval_data": req.eval_data, "eval_batches": n_batches,
        "eval_loss_before": before["eval_loss"], "eval_loss_after": after["eval_loss"],
        "perplexity_before": ppl(before["eval_loss"]), "perplexity_after": ppl(after["eval_loss"]),
        "perplexity_change": (ppl(after["eval_loss"]) / ppl(before["eval_loss"]) - 1.0) if before["eval_loss"] is not None else None,
        "forward_tokens_per_s_before": before["forward_tokens_per_s"],
        "forward_tokens_per_s_after": after["forward_tokens_per_s"],
        "timed_batch": [req.batch_size, req.seq_len],
        "max_abs_logit_diff_reloaded_vs_in_memory": logits_diff,
        "versions": {"torch": torch.__version__, "torchao": torchao.__version__, "transformers": transformers.__version__},
    }


def export_quantized(src: Path, out: Path, req: QuantizeRequest) -> dict[str, Any]:
    """`zerotrain export SRC OUT --quantize SCHEME`."""
    from ..config.schema import QuantSection

    if req.scheme not in quant.SCHEMES:
        raise UserError(f"--quantize {req.scheme}: unknown scheme; choose one of {', '.join(quant.SCHEMES)}")
    quant.torchao_config(req.scheme, 32)  # unsupported schemes and a missing torchao refuse before any work
    with tempfile.TemporaryDirectory(prefix=".zerotrain-export-", dir=Path(out).parent if Path(out).parent.exists() else None) as work:
        src_dir, qat = resolve_source(Path(src), Path(work))
        group = req.group_size or (qat or {}).get("group_size") or QuantSection().group_size
        return quantize_dir(src_dir, Path(out), req, group, source_label=str(src))
