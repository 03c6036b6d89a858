"""int8-static: int8 weights and int8 activations with scales calibrated ahead of time, through PyTorch 2 export
quantization (PT2E) with torchao's X86InductorQuantizer, saved as a `torch.export` program.

Why this path and not transformers' torchao loader: torchao's static config keeps the calibrated activation
scale in a tensor attribute (_act_quant_scale) that transformers' torchao loader does not restore on this stack
(from_pretrained fails with 'assert not leftover_state_dict'), and PT2E is PyTorch's own CPU-serving flow: the
x86 quantizer's quantize/dequantize pattern is what inductor lowers to oneDNN's fused int8 linear kernels, so the
compiled program is where static int8 pays (benchmarks/quantize.py measures it).

OUT holds model.pt2 (input_ids [batch, seq] -> logits [batch, seq, vocab], batch and seq dynamic, no KV cache),
config.json, the tokenizer, quantization_report.json and README.md (the loader lines below). It loads without zerotrain:

    import torch
    import torchao.quantization.pt2e  # registers the quantized_decomposed ops the program calls
    torch._inductor.config.freezing = True  # int8 weights pre-packed for oneDNN's fused int8 linear
    model = torch.compile(torch.export.load("OUT/model.pt2").module())
    logits = model(input_ids)

`load_program` below is those lines. Eager (uncompiled) the program runs its quantize/dequantize ops one by one
and is slower than fp32; compiled with freezing it is faster (quantization_report.json's latency).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from ..errors import UserError

PROGRAM_FILE = "model.pt2"
README = """# int8-static export (zerotrain export --quantize int8-static)

model.pt2 is a torch.export program: input_ids [batch, seq] -> logits [batch, seq, vocab] (no KV cache); int8 weights
and activations, scales calibrated ahead of time. It is not a from_pretrained directory; load it with PyTorch:

    import torch
    import torchao.quantization.pt2e  # registers the quantized_decomposed ops the program calls
    torch._inductor.config.freezing = True  # int8 weights pre-packed for oneDNN's fused int8 linear
    model = torch.compile(torch.export.load("model.pt2").module())
    logits = model(input_ids)

The tokenizer loads with AutoTokenizer.from_pretrained(this directory); quantization_report.json has the size,
perplexity and latency measured at export.
"""
"""Written into OUT as README.md: the directory says how to load itself."""


class LogitsOnly(torch.nn.Module):
    """The traced signature: input_ids -> logits, no cache (what a serving program computes per request)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def _export(module: torch.nn.Module, example: torch.Tensor, max_seq: int):
    from torch.export import Dim, export

    dims = {"input_ids": {0: Dim("batch", min=1, max=4096), 1: Dim("seq", min=1, max=max_seq)}}
    return export(module, (example,), dynamic_shapes=dims, strict=False)


def _head_name(model: torch.nn.Module) -> Optional[str]:
    head = model.get_output_embeddings()
    return next((n for n, m in model.named_modules() if m is head), None)


def _drop_unused_weights(gm: torch.fx.GraphModule) -> None:
    """convert_pt2e folds each weight into an int8 constant and leaves the fp32 original attached, unused:
    remove it, or the saved program would carry both."""
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name in [k for k, _ in gm.named_parameters()] + [k for k, _ in gm.named_buffers()]:
        if name not in used:
            owner, _, leaf = name.rpartition(".")
            delattr(gm.get_submodule(owner) if owner else gm, leaf)


def quantized_linears(gm: torch.fx.GraphModule) -> int:
    """Linear layers holding int8 weights in a converted program, the head included when it is (one per-channel
    weight dequantize each)."""
    return sum(n.op == "call_function" and "dequantize_per_channel" in str(n.target) for n in gm.graph.nodes)


def quantize_static(model: torch.nn.Module, calibration: Iterable[torch.Tensor], quantize_embeddings: bool,
                    max_seq: int) -> torch.fx.GraphModule:
    """A HF causal LM (fp32, eval) -> the converted PT2E program module: every Linear (the output head too with
    quantize_embeddings) with int8 per-channel weights and int8 per-tensor activations whose scales the
    calibration batches set (HistogramObserver, the x86 default); with quantize_embeddings the input embedding
    holds int8 weights per row (torchao's IntxWeightOnlyConfig, weight-only: a lookup has no activation)."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as xiq

    batches = list(calibration)
    if not batches:
        raise UserError("int8-static: --calibration-data gave no rows to calibrate with; pass a larger file")
    if quantize_embeddings:
        from torchao.quantization import quantize_

        from ..model.quant import embedding_config, untie_output_head

        untie_output_head(model)
        emb = model.get_input_embeddings()
        quantize_(model, embedding_config(), filter_fn=lambda m, fqn: m is emb)
    wrapped = LogitsOnly(model).eval()
    quantizer = xiq.X86InductorQuantizer().set_global(xiq.get_default_x86_inductor_quantization_config())
    head = _head_name(model)
    if head and not quantize_embeddings:
        quantizer.set_module_name_qconfig(f"model.{head}", None)  # the head stays fp32, as in the torchao schemes
    prepared = prepare_pt2e(_export(wrapped, batches[0], max_seq).module(), quantizer)
    from tqdm.auto import tqdm

    with torch.no_grad():
        for ids in tqdm(batches, desc="calibrating", unit="batch", leave=False):
            prepared(ids)
    converted = convert_pt2e(prepared)
    _drop_unused_weights(converted)
    return converted


def save_program(converted: torch.fx.GraphModule, example: torch.Tensor, out_dir: Path, max_seq: int,
                 config: Any, tokenizer: Any = None) -> None:
    """OUT/model.pt2 (the converted module exported again: a self-contained program), config.json, tokenizer.
    Each node's Python stack trace and provenance are dropped: at a small model they are a fifth of the file,
    and nothing that runs the program reads them."""
    program = _export(converted, example, max_seq)
    for node in program.graph.nodes:
        for key in ("stack_trace", "from_node"):
            node.meta.pop(key, None)
    torch.export.save(program, Path(out_dir) / PROGRAM_FILE)
    (Path(out_dir) / "README.md").write_text(README)
    config.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def load_program(model_dir: str | Path, compile: bool = True) -> torch.nn.Module:
    """The documented loader (module docstring): OUT/model.pt2 as a callable input_ids -> logits, compiled with
    inductor freezing (set for the process, as the loader in the docstring does) unless compile=False (eager:
    the program's ops one by one, for checking numbers)."""
    import torchao.quantization.pt2e  # noqa: F401  registers the quantized_decomposed ops the program calls

    path = Path(model_dir) / PROGRAM_FILE
    if not path.is_file():
        raise UserError(f"{model_dir} has no {PROGRAM_FILE}; it is not an int8-static export "
                        "(`zerotrain export SRC OUT --quantize int8-static --calibration-data FILE`)")
    module = torch.export.load(str(path)).module()
    if not compile:
        return module
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    return torch.compile(module)


def program_bytes(model_dir: Path) -> tuple[int, int]:
    """(bytes of model.pt2, bytes of the tensors inside it): the rest is the serialized graph, about 1.5 KB a
    node (0.6 MB for a 4-block Llama, the same for any width)."""
    import zipfile

    path = Path(model_dir) / PROGRAM_FILE
    with zipfile.ZipFile(path) as archive:
        tensors = sum(i.file_size for i in archive.infolist() if "/data/" in i.filename)
    return path.stat().st_size, tensors
