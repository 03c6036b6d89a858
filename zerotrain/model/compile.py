"""Regional compilation (--compile): each transformer block's forward compiled with torch.compile before the
engine wraps the model, torchtitan's way (compile per block, then FSDP2's fully_shard per block).

    plan = CompilePlan(mode="default", backend="inductor")
    n = compile_blocks(hf_model, transformer_blocks(hf_model), plan)  # the engines (Engine._compile): after
                                             # ModelPreparation.apply, before fully_shard / deepspeed.initialize
    watch = CompileWatch()                   # the trainer: compile time, graphs, recompiles per step

Why the block's `forward` and not the module (`block.compile()`): the engines' hooks live on the block module
(FSDP2's unshard/reshard, ZeRO-3's gather/release on leaf blocks, DeepSpeed's gradient hooks), and module
compilation would trace them; compiling `forward` leaves every hook eager around the compiled code. The blocks
are instances of one class, so dynamo compiles one graph for all of them (the parameters are graph inputs:
torch._dynamo.config.inline_inbuilt_nn_modules) once the KV cache is off (a cache passes each block its
layer index, one graph per block): every forward of the compiled model gets use_cache=False unless it says. Data padded to its longest row compiles for dynamic shapes from the start
(CompilePlan.dynamic); evaluation (no gradients) compiles once more, and so does a batch without padding after
padded ones (transformers then passes no attention mask and SDPA runs is_causal).

Importing it imports no torch (the plan holds a CompilePlan; `zerotrain config` builds plans).
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class CompilePlan:
    """What --compile asks for (config compile section)."""

    mode: str = "default"
    """torch.compile mode."""
    backend: str = "inductor"
    """torch.compile backend: inductor, or aot_eager (traced, eager kernels)."""
    dynamic: Optional[bool] = False
    """torch.compile's dynamic: True (any sequence length from the start) for data whose batches are padded to
    their longest row (chat, prompt-completion, unpacked text, pairs), where torch's automatic dynamic shapes was
    seen recompiling for a third length on the chat test; False for packed text (every row seq_len tokens),
    static shapes measured faster on CPU (1.16x vs 1.06x over eager, small-gpt2 fp32); None (automatic: static
    until a second length shows) where the data format is only known once read (--data-format auto on a
    .jsonl/.csv/.parquet)."""

    def describe(self, blocks: int) -> str:
        shapes = {True: "any sequence length", False: "static shapes (packed rows)",
                  None: "automatic dynamic shapes"}[self.dynamic]
        return (f"compile: {blocks} transformer blocks, torch.compile {self.backend} (mode {self.mode}, {shapes}), "
                "one compiled code shared by every block; compiled at the first step")


def compile_blocks(model: "torch.nn.Module", blocks: list["torch.nn.Module"], plan: CompilePlan) -> int:
    """Compile the forward of every transformer block (facts.transformer_blocks of the prepared HF model); returns
    how many (also kept on the model for the banner)."""
    import torch

    if hasattr(getattr(model, "config", None), "use_cache"):
        # a KV cache passes each block its layer index: one graph per block. Training keeps none; the config is
        # left as it is, so the exported model still generates with a cache.
        model.forward = functools.partial(_without_cache, model.forward)
    options = {} if plan.mode == "default" else {"mode": plan.mode}
    import torch._dynamo.config as dynamo

    # On the H100, DeepSpeed ZeRO-3's parameter dict (its ds_id checks) made dynamo guard every block on its own
    # parameter ids: one graph per block, and past torch's recompile limit (8) the other blocks ran eagerly
    # without a word (benchmarks/RESULTS_GPU.md). Integer attributes stay unspecialised, and the limit covers
    # one graph per block in each mode (train, eval) so no block silently falls back.
    dynamo.allow_unspec_int_on_nn_module = True
    dynamo.recompile_limit = max(dynamo.recompile_limit, 4 * len(blocks) + 8)
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=plan.backend, dynamic=plan.dynamic, **options)
    model._zt_compiled_blocks = len(blocks)
    return len(blocks)


def _without_cache(forward: Any, *args: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("use_cache", False)
    return forward(*args, **kwargs)


def _compile_seconds() -> float:
    """Seconds torch.compile has spent in this process so far (dynamo + AOTAutograd + inductor, forward graphs
    and the backward graphs they compile lazily)."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(sum(compilation_time_metrics.get(k, ())) for k in ("_compile.compile_inner", "backward._backward_impl"))


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompileWatch:
    """Graphs compiled and the time spent compiling, step by step: the first step's compile, then every
    recompile (a metrics.jsonl record and a line each)."""

    def __init__(self) -> None:
        self.graphs, self.seconds = _graphs(), _compile_seconds()
        self.first_step: Optional[int] = None
        self.recompiles = 0
        self.total_graphs = 0
        self.total_seconds = 0.0

    def after(self, step: int, what: str = "train") -> Optional[dict[str, Any]]:
        """The record of what compiled during `step` (None if nothing did)."""
        graphs, seconds = _graphs(), _compile_seconds()
        new, spent = graphs - self.graphs, seconds - self.seconds
        self.graphs, self.seconds = graphs, seconds
        if new <= 0:
            return None
        self.total_graphs += new
        self.total_seconds += spent
        first = self.first_step is None
        if first:
            self.first_step = step
        else:
            self.recompiles += new
        return {"event": "compile", "step": step, "during": what, "new_graphs": new, "compile_s": round(spent, 3),
                "recompile": not first, "recompiles": self.recompiles, "time": time.time()}

    @staticmethod
    def line(rec: dict[str, Any], blocks: int = 0) -> str:
        """One line for the console (blocks: how many were compiled, to say when they did not share one graph)."""
        if not rec["recompile"]:
            shared = "" if rec["new_graphs"] <= 2 or not blocks else (
                f"; the {blocks} blocks did not share one graph (TORCH_LOGS=recompiles says why)")
            return (f"compile: {rec['new_graphs']} graph(s) compiled in {rec['compile_s']:.1f} s during step "
                    f"{rec['step']} ({rec['during']}){shared}")
        return (f"compile: recompiled {rec['new_graphs']} graph(s) in {rec['compile_s']:.1f} s during step {rec['step']} "
                f"({rec['during']}; a new shape or mode; {rec['recompiles']} recompile(s) so far)")

    def summary(self) -> dict[str, Any]:
        return {"compile_s": round(self.total_seconds, 3), "compiled_graphs": self.total_graphs,
                "recompiles": self.recompiles}
