"""`zerotrain export SRC OUT --quantize SCHEME`: a quantized model directory and its quantization_report.json.

SRC is a HF model directory (a run's final/, its merged/ LoRA model), a checkpoint dir, a checkpoints/
root or a run output dir (exported to full precision first). The torchao schemes write a HF directory that
from_pretrained reloads; int8-static writes a torch.export program next to the HF config
(zerotrain/export/static_int8.py). The report holds what a user decides on: bytes on disk against the
full-precision source, eval loss / perplexity before and after (--eval-data, same data pipeline as training),
serving latency of the fp32 and the quantized model on this machine, eager and compiled, at a prefill batch and
a decode-like step (zerotrain/export/latency.py), and the largest logit difference between the reloaded
output and the in-memory quantized model.
"""
from __future__ import annotations

import copy
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ..errors import UserError
from ..model import quant
from . import latency, static_int8

REPORT_FILE = "quantization_report.json"
TIMING = {"both": latency.MODES, "eager": ("eager",), "compiled": ("compiled",), "off": ()}
"""--serve-timing: which serving modes the report times."""
CALIBRATION_BATCHES = 8


@dataclass(frozen=True)
class QuantizeRequest:
    scheme: str
    """One of quant.SCHEMES."""
    group_size: Optional[int] = None
    """int4 schemes; None: a QAT source's own group size, else RunConfig's default."""
    eval_data: Optional[str] = None
    """Text/chat data file for eval loss before and after (None: no perplexity in the report)."""
    seq_len: int = 128
    """Tokens per eval, calibration and timed prefill row."""
    batch_size: int = 4
    """Rows per forward pass for eval, calibration and the timed prefill batch."""
    eval_batches: int = 32
    """At most this many eval batches."""
    calibration_data: Optional[str] = None
    """int8-static: text/chat data whose activations set the static scales (not the eval split)."""
    calibration_batches: Optional[int] = None
    """int8-static: at most this many calibration batches (None: CALIBRATION_BATCHES)."""
    quantize_embeddings: bool = False
    """Also quantize the input embedding and the output head (int8 weight-only; int8-static: the head static)."""
    serve_timing: str = "both"
    """Which serving modes to time: a key of TIMING (compiling costs seconds per model and shape)."""


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


def _data_batches(path: str, req: QuantizeRequest, tokenizer, most: int) -> list[dict[str, torch.Tensor]]:
    from ..config.load import build_config
    from ..data.datasets import prepare_data

    cfg = build_config(overrides={"data.path": path, "data.seq_len": req.seq_len, "data.eval_split": 0.0})
    data = prepare_data(cfg, tokenizer)
    rows = [data.train[i] for i in range(min(len(data.train), req.batch_size * most))]
    return [data.collate(rows[i:i + req.batch_size]) for i in range(0, len(rows), req.batch_size)]


def logits_forward(model: torch.nn.Module) -> latency.Forward:
    """A HF causal LM as the callable every served model is here: input_ids -> logits."""
    return static_int8.LogitsOnly(model).eval()


@torch.no_grad()
def eval_loss(forward: latency.Forward, batches: list[dict[str, torch.Tensor]], desc: str = "eval") -> float:
    """Token-weighted mean next-token loss over the batches (labels -100 are not counted). Rows are right-padded
    and the attention causal, so the logits of real tokens do not see the padding."""
    from tqdm.auto import tqdm

    total, count = 0.0, 0
    for b in tqdm(batches, desc=desc, unit="batch", leave=False):
        logits = forward(b["input_ids"])[:, :-1].float()
        labels = b["labels"][:, 1:]
        total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                          ignore_index=-100, reduction="sum"))
        count += int((labels != -100).sum())
    return total / max(count, 1)


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


def _check_request(req: QuantizeRequest) -> None:
    """Settings that mean nothing for the scheme are refused in one line, before any work."""
    static = req.scheme == "int8-static"
    if static and not req.calibration_data:
        raise UserError("--quantize int8-static: pass --calibration-data FILE (text or chat data like the model's "
                        "inputs, not the --eval-data split): its activations set the static scales")
    if not static and (req.calibration_data or req.calibration_batches is not None):
        flag = "--calibration-data" if req.calibration_data else "--calibration-batches"
        raise UserError(f"{flag}: only --quantize int8-static calibrates ({req.scheme} quantizes activations at run "
                        "time or not at all); drop it")
    if req.calibration_batches is not None and req.calibration_batches < 1:
        raise UserError(f"--calibration-batches {req.calibration_batches}: pass at least 1")
    if req.group_size is not None and not quant.SCHEMES[req.scheme].grouped:
        raise UserError(f"--quant-group-size: {req.scheme} quantizes per output channel, not in groups; drop it "
                        "(it is for int4-weight and int8-dynamic-int4-weight)")
    if req.serve_timing not in TIMING:
        raise UserError(f"--serve-timing {req.serve_timing}: choose one of {', '.join(TIMING)}")


def quantize_dir(src_dir: Path, out: Path, req: QuantizeRequest, group_size: int,
                 source_label: Optional[str] = None) -> dict[str, Any]:
    """Full-precision HF dir -> quantized dir at OUT (written whole, then moved into place) + report."""
    model, tokenizer = _load(src_dir)
    quant.check_model(model, req.scheme, group_size, "--quantize")
    if (req.eval_data or req.calibration_data) and tokenizer is None:
        raise UserError(f"{'--eval-data' if req.eval_data else '--calibration-data'}: {src_dir} has no tokenizer "
                        "to read the data with")
    batches = _data_batches(req.eval_data, req, tokenizer, req.eval_batches) if req.eval_data else []
    if req.calibration_data and req.eval_data and Path(req.calibration_data).resolve() == Path(req.eval_data).resolve():
        print(f"warning: --calibration-data is the --eval-data file ({req.eval_data}): the perplexity after is "
              "measured on the data that set the scales, so it reads better than on unseen data", flush=True)
    ids = latency.serve_ids(latency.serve_shapes(req.batch_size, req.seq_len)[0], model.config.vocab_size)
    fp32 = logits_forward(model)
    loss_before = eval_loss(fp32, batches, "eval fp32") if batches else None
    full = copy.deepcopy(model)  # timed beside the quantized model
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if quant.SCHEMES[req.scheme].artifact == "program":
            calibration = _data_batches(req.calibration_data, req, tokenizer,
                                        req.calibration_batches or CALIBRATION_BATCHES)
            max_seq = int(getattr(model.config, "max_position_embeddings", 0) or 4096)
            converted = static_int8.quantize_static(model, [b["input_ids"] for b in calibration],
                                                    req.quantize_embeddings, max_seq)
            with torch.no_grad():
                in_memory = converted(ids)
            static_int8.save_program(converted, ids, tmp, max_seq, model.config, tokenizer)
            layers = static_int8.quantized_linears(converted) - (1 if req.quantize_embeddings else 0)  # the head
            del converted, model
            served = static_int8.load_program(tmp, compile=False)  # what a user's loader gets, eager
            left = len(quant.quantizable_linears(full)) - layers
            schemes = {"int8-static": layers, **({"none": left} if left else {})}  # as layer_schemes counts
            embeddings = {"input_embedding": "int8-weight" if req.quantize_embeddings else "none",
                          "output_head": "int8-static" if req.quantize_embeddings else "none"}
            out_bytes, tensor_bytes = static_int8.program_bytes(tmp)
            calibrated = len(calibration)
        else:
            from transformers import AutoModelForCausalLM

            layers = quant.quantize_model(model, req.scheme, group_size, embeddings=req.quantize_embeddings)
            with torch.no_grad():
                in_memory = model(input_ids=ids).logits
            quant.save_quantized(model, tmp, req.scheme, group_size, tokenizer, embeddings=req.quantize_embeddings)
            del model
            reloaded = AutoModelForCausalLM.from_pretrained(tmp).eval()  # what a user's from_pretrained gets
            served = logits_forward(reloaded)
            schemes, embeddings = quant.layer_schemes(reloaded), quant.embedding_schemes(reloaded)
            out_bytes = tensor_bytes = quant.weights_bytes(tmp)
            calibrated = None
        with torch.no_grad():
            logits_diff = float((served(ids) - in_memory).abs().max())
        loss_after = eval_loss(served, batches, f"eval {req.scheme}") if batches else None
        modes = TIMING[req.serve_timing]
        if modes:
            print(f"timing the fp32 and the quantized model ({', '.join(modes)}; prefill {req.batch_size} x "
                  f"{req.seq_len}, decode 1 x 1){'; compiling takes a while' if 'compiled' in modes else ''}"
                  " (--serve-timing off skips it)", flush=True)
        timed = latency.measure({"fp32": logits_forward(full), "quantized": served}, full.config.vocab_size,
                                latency.serve_shapes(req.batch_size, req.seq_len), modes)
        report = _report(req, group_size, src_dir, (out_bytes, tensor_bytes), source_label, layers, schemes, embeddings,
                         loss_before, loss_after, timed, logits_diff, len(batches), calibrated)
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")
        quant.replace_dir(tmp, out)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def _report(req, group_size, src_dir, sizes, source_label, layers, schemes, embeddings, loss_before,
            loss_after, timed, logits_diff, n_batches, n_calibration) -> dict[str, Any]:
    import torchao
    import transformers

    src_bytes, (out_bytes, tensor_bytes) = quant.weights_bytes(src_dir), sizes

    def ppl(loss):
        return math.exp(loss) if loss is not None else None

    vs_fp32 = latency.ratios(timed, "quantized", "fp32")  # {} when nothing was timed
    q = timed["quantized"]
    faster = (min(q, key=lambda mode: q[mode]["prefill"]["median_ms"]) if q else None)
    return {
        "scheme": req.scheme, "group_size": group_size if quant.SCHEMES[req.scheme].grouped else None,
        "artifact": quant.SCHEMES[req.scheme].artifact, "quantize_embeddings": req.quantize_embeddings,
        "source": source_label or str(src_dir), "layers_quantized": layers, "layer_schemes": schemes,
        "embedding_schemes": embeddings, "calibration_data": req.calibration_data,
        "calibration_batches": n_calibration,
        "bytes_source": src_bytes, "bytes_quantized": out_bytes, "size_ratio": out_bytes / src_bytes,
        "bytes_quantized_tensors": tensor_bytes, "size_ratio_tensors": tensor_bytes / src_bytes,
        "eval_data": req.eval_data, "eval_batches": n_batches,
        "eval_loss_before": loss_before, "eval_loss_after": loss_after,
        "perplexity_before": ppl(loss_before), "perplexity_after": ppl(loss_after),
        "perplexity_change": (ppl(loss_after) / ppl(loss_before) - 1.0) if loss_before is not None else None,
        "timed_shapes": {s.name: [s.batch, s.seq] for s in latency.serve_shapes(req.batch_size, req.seq_len)},
        "latency_ms": timed,
        "latency_vs_fp32_same_mode": vs_fp32,
        "compiled_vs_fp32_eager": ({shape: t["median_ms"] / timed["fp32"]["eager"][shape]["median_ms"]
                                    for shape, t in q["compiled"].items()} if "compiled" in q and "eager" in q else None),
        "serving_path": faster,
        "max_abs_logit_diff_reloaded_vs_in_memory": logits_diff,
        "versions": {"torch": torch.__version__, "torchao": torchao.__version__, "transformers": transformers.__version__},
    }


def export_quantized(src: Path, out: Path, req: QuantizeRequest) -> dict[str, Any]:
    """`zerotrain export SRC OUT --quantize SCHEME`."""
    from ..config.schema import QuantSection

    if req.scheme not in quant.SCHEMES:
        raise UserError(f"--quantize {req.scheme}: unknown scheme; choose one of {', '.join(quant.SCHEMES)}")
    quant.import_torchao()  # a missing torchao refuses before any work
    _check_request(req)
    with tempfile.TemporaryDirectory(prefix=".zerotrain-export-", dir=Path(out).parent if Path(out).parent.exists() else None) as work:
        src_dir, qat = resolve_source(Path(src), Path(work))
        group = req.group_size or (qat or {}).get("group_size") or QuantSection().group_size
        return quantize_dir(src_dir, Path(out), req, group, source_label=str(src))
