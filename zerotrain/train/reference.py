"""Where a reference model's log-probs come from (dpo, kto): a --ref-model built in fp32 and checked against the
policy's vocabulary, LoRA's base (the policy with its adapters off), a frozen copy the engine holds
(Engine.auxiliary), or tables precomputed before the first step and saved in the run dir, which a resume loads back
(checked by a fingerprint of what they depend on). The reference classes themselves are zerotrain/train/preference.py's.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..distributed.agree import agree
from ..errors import UserError
from ..tasks import ReferencePlan
from .preference import ForwardReference, Reference

REFERENCE_FILE = "reference_logps.pt"
"""Under the run dir: the precomputed reference log-probs (--precompute-ref), {split: [pairs, 2]} by pair index."""


def reference_factory(ref: ReferencePlan, policy_factory: Any, policy_config: Any) -> Any:
    """The builder of the frozen reference: --ref-model's (checked: a causal LM with the policy's vocabulary;
    a LoRA adapter dir is merged into its base as it loads), else the policy's own starting weights."""
    if ref.path is None:
        return policy_factory
    return RefModelBuilder(ref.path, policy_config)


@dataclass
class RefModelBuilder:
    """Builds --ref-model in fp32: a HF model dir or hub id, or a peft adapter dir merged into its base."""

    path: str
    policy_config: Any

    @property
    def adapter(self) -> bool:
        return (Path(self.path).expanduser() / "adapter_config.json").is_file()

    def check(self) -> None:
        """Refuse (one line) a reference that is not a causal LM over the policy's vocabulary."""
        from transformers import AutoConfig

        try:
            if self.adapter:
                from peft import PeftConfig

                base = PeftConfig.from_pretrained(self.path).base_model_name_or_path
                config = AutoConfig.from_pretrained(base)
            else:
                config = AutoConfig.from_pretrained(self.path)
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"--ref-model {self.path}: cannot load its config ({str(e).splitlines()[0]}); pass a HF "
                            "model dir, hub id or an SFT run's final/") from None
        mine, theirs = _vocab(self.policy_config), _vocab(config)
        if mine != theirs:
            raise UserError(f"--ref-model {self.path}: its vocabulary has {theirs} tokens, the policy's {mine}; the "
                            "log-probabilities would not be of the same tokens: pass a reference with the policy's "
                            "tokenizer (e.g. the SFT run the policy starts from)")

    def __call__(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        if self.adapter:
            from peft import AutoPeftModelForCausalLM

            return AutoPeftModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).merge_and_unload()
        return AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32)


def _vocab(config: Any) -> Optional[int]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "vocab_size", None)


def precompute(engine: Any, data: Any, reference: Reference, micro_batch: int) -> dict[str, torch.Tensor]:
    """Every pair's reference log-probs, {split: [pairs, 2]} on every rank: each rank runs its share of the
    pairs in order (the same number of batches on every rank), then one all_gather."""
    from ..data.datasets import eval_loader

    tables = {}
    splits = ["train"] + (["eval"] if data.eval is not None else [])
    for split in splits:
        rows = []
        loader = eval_loader(data, engine.dp_rank, engine.plan.world.dp, micro_batch, split)
        for batch in loader:
            valid = batch.pop("valid")
            c, r = reference.logps(engine, engine.to_device(batch))
            rows.append(torch.stack([batch["pair_index"].double(), c.detach().double().cpu(),
                                     r.detach().double().cpu(), valid.double()], dim=1))
        local = gather_rows(torch.cat(rows) if rows else torch.zeros((0, 4), dtype=torch.float64))
        n = len(data.train if split == "train" else data.eval)
        table = torch.full((n, 2), float("nan"), dtype=torch.float64)
        kept = local[local[:, 3] > 0]
        table[kept[:, 0].long()] = kept[:, 1:3]
        tables[split] = table.float()
    return tables


def gather_rows(local: torch.Tensor) -> torch.Tensor:
    """Every rank's [rows, k] float64 table, rank after rank, on every rank (one all_gather; every rank holds the
    same number of rows: the same number of batches of the same size)."""
    import torch.distributed as tdist

    from ..distributed.collectives import comm_device, is_distributed

    if not is_distributed():
        return local
    dev = comm_device()
    everything = torch.empty((tdist.get_world_size() * local.shape[0], local.shape[1]), dtype=torch.float64,
                             device=dev)
    tdist.all_gather_into_tensor(everything, local.to(dev).contiguous())
    return everything.cpu()


def save_tables(path: Path, tables: dict[str, torch.Tensor], fingerprint: str) -> None:
    """Rank 0: write the precomputed table atomically (a resume reads it)."""
    tmp = path.with_suffix(".tmp")
    torch.save({"fingerprint": fingerprint, "tables": tables}, tmp)
    tmp.replace(path)


def load_tables(path: Path, fingerprint: str) -> dict[str, torch.Tensor]:
    """The table a previous --precompute-ref pass of this run saved."""
    if not path.is_file():
        raise UserError(f"--resume with --precompute-ref: {path} is missing (it is written before the first step); "
                        "resume without --precompute-ref, or start the run again")
    saved = torch.load(path, weights_only=True)
    if saved.get("fingerprint") != fingerprint:
        raise UserError(f"--resume with --precompute-ref: {path} was computed for other data or another reference; "
                        "resume with the run's --data and --ref-model")
    return saved["tables"]


def live_reference(setup: Any, engine: Any, ref_plan: ReferencePlan, split: bool, chunked: int) -> ForwardReference:
    """The reference run alongside the policy: LoRA's base (the adapters disabled, no second copy) or a frozen copy
    (--ref-model's or the starting weights) the engine holds partitioned like the policy (Engine.auxiliary)."""
    if ref_plan.adapters_off:  # the base itself: the policy with its adapters disabled, no second copy
        return ForwardReference(None, "the policy with its LoRA adapters disabled",
                                adapters_off=engine.hf_model.disable_adapter, split=split, chunked=chunked)
    factory = reference_factory(ref_plan, setup.model_factory(), setup.source.hf_config)
    what = f"a frozen copy of {ref_plan.path}" if ref_plan.path else "a frozen copy of the starting weights"
    frozen = frozen_copy(engine, factory, chunked)
    return ForwardReference(frozen, what, split=split, chunked=chunked)


def frozen_copy(engine: Any, factory: Any, chunked: int) -> Any:
    """The engine's frozen copy of what `factory` builds (Engine.auxiliary "reference"), given the policy's chunked
    head when --chunked-loss is on: the same log-prob code as the policy's, so equal weights give equal log-probs,
    bit for bit."""
    frozen = engine.auxiliary("reference", factory).model
    if chunked:
        from ..model.memory_reducers import apply

        apply(getattr(frozen, "module", frozen), 0, chunked)  # a DeepSpeed engine holds the HF model
    return frozen


def precomputed_tables(setup: Any, engine: Any, ref_plan: ReferencePlan, split: bool, chunked: int,
                       compute: Callable[[Reference], dict[str, torch.Tensor]], *depends_on: Any) -> dict:
    """--precompute-ref: the tables compute(reference) gives (every rank), saved in the run dir by rank 0; a resume
    loads them instead (checked against what they depend on: the data, the reference, the dtype, depends_on)."""
    if setup.resume_from is not None:
        return load_tables(setup.run_dir.root / REFERENCE_FILE,
                           _reference_fingerprint(setup, ref_plan, engine.plan.dtype, *depends_on))
    # the starting weights are the policy's own before its first step: no copy needed
    ref = ForwardReference(None, "the policy", split=split, chunked=chunked) \
        if ref_plan.path is None and not ref_plan.adapters_off else live_reference(setup, engine, ref_plan, split,
                                                                                  chunked)
    tables = compute(ref)
    ref.close()
    engine.release_auxiliary("reference")
    store_tables(setup, engine, ref_plan, tables, *depends_on)
    return tables


def store_tables(setup: Any, engine: Any, ref_plan: ReferencePlan, tables: dict, *depends_on: Any) -> None:
    """Rank 0 writes the precomputed tables in the run dir (every rank learns whether it could: agree)."""
    path = setup.run_dir.root / REFERENCE_FILE
    fingerprint = _reference_fingerprint(setup, ref_plan, engine.plan.dtype, *depends_on)

    def write() -> None:
        if engine.is_main:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_tables(path, tables, fingerprint)

    agree(write, "--precompute-ref", bad_input=(OSError,))


def _reference_fingerprint(setup: Any, ref: ReferencePlan, dtype: str, *depends_on: Any) -> str:
    """What the precomputed table depends on: the tokenized rows, the reference's weights, the dtype (and what the
    task adds: KTO's data order)."""
    import hashlib

    cfg, data = setup.cfg, setup.data
    parts = (data.train._fingerprint, data.eval._fingerprint if data.eval is not None else None, cfg.model.name,
             ref.path, dtype, *depends_on)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
