"""`zerotrain export CKPT_DIR OUT_DIR`: a checkpoint of either backend -> a HF model directory.

    zerotrain export runs/demo/checkpoints out/hf          # the run's latest complete checkpoint
    zerotrain export runs/demo/checkpoints/global_step200 out/hf

Runs in one process, whatever world size and ZeRO stage wrote the checkpoint: DeepSpeed
checkpoints go through deepspeed.utils.zero_to_fp32, FSDP ones through torch.distributed.checkpoint
without a process group. Writes fp32 safetensors, config.json and the tokenizer if it was saved.
The checkpoint's files are read safely (backends/checkpointing.py): a file that needs a type no checkpoint holds is
refused in one line, unless --trust-checkpoint says the checkpoint is trusted.
A LoRA checkpoint gives the adapter (adapter_config.json, adapter_model.safetensors), and with
--merge-lora also OUT_DIR/merged, the base with the adapter merged in.

    zerotrain export runs/llama/final out/int8 --quantize int8-dynamic --eval-data val.jsonl

    zerotrain export runs/llama/final out/static --quantize int8-static --calibration-data train.txt --quantize-embeddings

--quantize writes a torchao-quantized HF directory, or for int8-static a torch.export program next to the HF
config (zerotrain/export/quantized.py), from a run's final/, any HF model dir or a checkpoint, with
quantization_report.json (size, perplexity, and serving latency eager and compiled, before and after).

OUT_DIR is written aside (a hidden sibling, .NAME.partial-PID/) and renamed into place only when complete: an export
that fails (a full disk: one line naming the path and the OS's text, exit 2) leaves no OUT_DIR, or the earlier one
as it was, and never touches the checkpoint.
"""
from __future__ import annotations

import argparse
import contextlib
from typing import Iterator

from ..errors import EnvironmentFault, UserError, os_error_line, staged_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt_dir", metavar="CKPT_DIR",
                   help="a checkpoint dir (global_stepN), a checkpoints/ root (its latest), or a run output dir")
    p.add_argument("out_dir", metavar="OUT_DIR", help="where to write the HF model (save_pretrained layout)")
    p.add_argument("--merge-lora", action="store_true",
                   help="LoRA checkpoint: also write OUT_DIR/merged, the base with the adapter merged in")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="read the checkpoint's files as they are, unpickling whatever they hold (default: read "
                        "safely, refusing a file that needs a type no checkpoint holds); only for a checkpoint you trust")
    from ..export.quantized import CALIBRATION_BATCHES, TIMING
    from ..model.quant import SCHEMES

    q = p.add_argument_group("quantized export (torchao)")
    q.add_argument("--quantize", choices=list(SCHEMES), default=None,
                   help="write a quantized HF model: " + "; ".join(f"{s.name}: {s.summary}" for s in SCHEMES.values()))
    q.add_argument("--quant-group-size", type=int, default=None,
                   help="int4 schemes: weights per group (default: a QAT run's own, else 32)")
    q.add_argument("--quantize-embeddings", action="store_true",
                   help="also quantize the input embedding and the output head (int8 weight-only; int8-static: the "
                        "head static int8): the smallest model, perplexity in the report")
    q.add_argument("--calibration-data", default=None,
                   help="int8-static: text/chat data whose activations set the static scales (not the eval split)")
    q.add_argument("--calibration-batches", type=int, default=None,
                   help=f"int8-static: at most this many calibration batches (default {CALIBRATION_BATCHES})")
    q.add_argument("--eval-data", default=None, help="text/chat data file: eval loss and perplexity before and after")
    q.add_argument("--seq-len", type=int, default=128,
                   help="tokens per eval, calibration and timed prefill row (default 128)")
    q.add_argument("--batch-size", type=int, default=4,
                   help="rows per forward pass, and the timed prefill batch (default 4)")
    q.add_argument("--eval-batches", type=int, default=32, help="at most this many eval batches (default 32)")
    q.add_argument("--serve-timing", choices=list(TIMING), default="both",
                   help="time the fp32 and quantized models eager, torch.compile'd (freezing), both (default) or off")


def run(args: argparse.Namespace) -> int:
    from ..backends.checkpointing import trusting

    with trusting(args.trust_checkpoint):  # every checkpoint file read safely unless trusted
        return _export(args)


def _export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..checkpoint import store as ck
    from ..export.to_hf import export_checkpoint

    src = Path(args.ckpt_dir)
    if args.quantize:
        return _quantized(args, src)
    if not src.exists():
        raise UserError(f"export: {src} does not exist; pass a checkpoint dir or a run's checkpoints/ dir")
    path = ck.resolve_checkpoint(src)
    meta = ck.read_meta(path)
    out = Path(args.out_dir)
    _check_replaceable(out, path)
    with _os_errors(path, out):
        with staged_dir(out) as tmp:  # written aside, renamed onto OUT_DIR when complete
            export_checkpoint(path, tmp, merge_lora=args.merge_lora)
    print(f"exported {path} ({meta.backend}, ZeRO stage {meta.zero_stage}, {meta.world_size} ranks, "
          f"step {meta.global_step}) -> {out}", flush=True)
    return 0


def _check_replaceable(out, src) -> None:
    """OUT_DIR is replaced whole when the export is complete: refuse one that holds the checkpoint, or anything
    but an earlier export (a HF model or adapter directory) or nothing."""
    from pathlib import Path

    if Path(src).resolve().is_relative_to(out.resolve()):
        raise UserError(f"export: OUT_DIR {out} holds the checkpoint {src}; pick a new OUT_DIR")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not any(
            (out / f).is_file() for f in ("config.json", "adapter_config.json")))):
        raise UserError(f"export: OUT_DIR {out} exists and is not a model directory (no config.json); the export "
                        "replaces OUT_DIR whole, so pick a new OUT_DIR (or empty this one)")


@contextlib.contextmanager
def _os_errors(src, out) -> Iterator[None]:
    """An OS error while exporting (a full disk under OUT_DIR) -> one line: the source is only read, and OUT_DIR
    is written aside and renamed into place, so nothing partial is left and an earlier OUT_DIR is as it was."""
    existed = out.exists()
    try:
        yield
    except OSError as e:
        raise EnvironmentFault(os_error_line(
            e, None, f"export {src} -> {out}",
            kept=f"{src} untouched; " + (f"the earlier {out} as it was" if existed else f"no {out} written"),
            fix="export again")) from None


def _quantized(args: argparse.Namespace, src) -> int:
    from pathlib import Path

    from ..export.quantized import REPORT_FILE, QuantizeRequest, export_quantized

    if args.merge_lora:
        raise UserError("export: --merge-lora and --quantize are separate steps; export with --merge-lora, then "
                        "quantize OUT/merged")
    req = QuantizeRequest(scheme=args.quantize, group_size=args.quant_group_size, eval_data=args.eval_data,
                          seq_len=args.seq_len, batch_size=args.batch_size, eval_batches=args.eval_batches,
                          calibration_data=args.calibration_data, calibration_batches=args.calibration_batches,
                          quantize_embeddings=args.quantize_embeddings, serve_timing=args.serve_timing)
    with _os_errors(src, Path(args.out_dir)):
        r = export_quantized(src, Path(args.out_dir), req)
    ppl = (f"; perplexity {r['perplexity_before']:.3f} -> {r['perplexity_after']:.3f}"
           if r["perplexity_before"] is not None else "")
    speed = "".join(f"; {mode} prefill latency {ratio['prefill']:.2f}x fp32's"
                    for mode, ratio in r["latency_vs_fp32_same_mode"].items())
    print(f"quantized {src} ({r['scheme']}, {r['layers_quantized']} Linear layers) -> {args.out_dir}: "
          f"{r['bytes_quantized']:,} bytes ({r['size_ratio']:.2f}x the source){ppl}{speed}; "
          f"report {args.out_dir}/{REPORT_FILE}", flush=True)
    return 0
