"""The engine's checkpoint I/O: the commit protocol around a backend's shards, and reading checkpoint files safely.

Saving (zerotrain/checkpoint/store.py holds the directory protocol): every rank writes its rank state and its shards
(the backend's _write_shards, or _write_shards_async under --async-save), rank 0 the HF config and tokenizer; then
every rank's result is gathered and rank 0 makes the tag `latest` only when every rank wrote all of its files, else
removes it (_settle). A rank's OSError (a full disk) is a failed save, not a crash: it is appended to
engine.save_failures and the trainer stops after ck.MAX_FAILED_SAVES in a row. The functions take the engine; its
public methods (Engine.save_checkpoint, load_checkpoint, commit_pending_save, finish_pending_save) call them.

Reading: a checkpoint's .pt files are pickles, and unpickling one can run any code it names. read_file loads with
torch.load(weights_only=True), allowing by name only the few types zerotrain's and DeepSpeed's files hold
(SAFE_TYPES; a rank state's own dataclasses); a file that needs another is refused in one line naming the type.
DeepSpeed's readers (its engine's load_checkpoint, zero_to_fp32, ds_to_universal) unpickle with weights_only=False and
torch.distributed.checkpoint reads its .metadata with pickle.load, so vet_files reads every such file of a checkpoint
safely first. --trust-checkpoint (RunConfig.run.trust_checkpoint,
`zerotrain export --trust-checkpoint`; the trusting() context) reads everything as it is.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import pickle
import re
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch

from ..checkpoint import store as ck
from ..checkpoint.async_save import PendingSave, Ticket, write_error_text
from ..distributed.agree import agree
from ..errors import UserError

SAFE_TYPES: dict[str, str] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": "the loss scaler in DeepSpeed's optimizer files",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": "the fp16 loss scaler in DeepSpeed's optimizer files",
    "deepspeed.runtime.zero.config.ZeroStageEnum": "the ZeRO stage in DeepSpeed's optimizer files",
    "deepspeed.utils.tensor_fragment.fragment_address": "a parameter's place in DeepSpeed's ZeRO 1/2 optimizer files",
}
"""The types beyond torch's own (tensors, plain containers, numbers, strings) that a checkpoint's files may hold,
found by loading the files zerotrain's runs write (tests/unit/test_safe_reads.py loads the committed fixtures)."""
DCP_METADATA_TYPES: frozenset[str] = frozenset({
    *(f"torch.distributed.checkpoint.metadata.{n}" for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    "torch.distributed.checkpoint.filesystem._StorageInfo", "torch.Size", "torch.serialization._get_layout",
    "pathlib.PosixPath", "pathlib.WindowsPath", "collections.OrderedDict"})
"""What a torch.distributed.checkpoint directory's .metadata (a plain pickle, which DCP reads with pickle.load) holds,
beside torch's dtypes; found by reading the committed FSDP fixtures' and the FSDP runs' files."""
TRUST_FLAG = "--trust-checkpoint"
_TRUSTED: contextvars.ContextVar[bool] = contextvars.ContextVar("zerotrain_trust_checkpoint", default=False)


@contextlib.contextmanager
def trusting(trust: bool) -> Iterator[None]:
    """Inside: every checkpoint read unpickles as it is when `trust` (the user's --trust-checkpoint), safely if not."""
    token = _TRUSTED.set(bool(trust))
    try:
        yield
    finally:
        _TRUSTED.reset(token)


def _refusal(path: Path, name: str) -> str:
    return (f"{path}: reading it would load {name}, which is none of the types a zerotrain or DeepSpeed checkpoint "
            f"holds (a crafted file can run code this way); pass {TRUST_FLAG} only if you trust where the checkpoint "
            "came from")


def _allowed(name: str, path: Path, own_types: bool) -> Any:
    """The object a global `name` of `path` stands for, when it may be loaded (SAFE_TYPES; with own_types a dataclass
    of zerotrain's own: a rank state's); else the refusal."""
    module, _, attr = name.rpartition(".")
    if name in SAFE_TYPES or (own_types and module.split(".")[0] == "zerotrain"):
        try:
            obj = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            raise UserError(f"{path}: it holds {name}, which this installation cannot import; read it where the "
                            "checkpoint was written (the same zerotrain and DeepSpeed versions)") from None
        if name in SAFE_TYPES or (isinstance(obj, type) and dataclasses.is_dataclass(obj)):
            return obj
    raise UserError(_refusal(path, name))


def read_file(path: str | Path, *, own_types: bool = False, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """One checkpoint file (torch.save), read safely unless the user trusts the checkpoint (trusting): tensors, plain
    containers and SAFE_TYPES (own_types: also zerotrain's own dataclasses, which a rank state holds). A file that
    needs anything else is refused with one UserError line naming the type and --trust-checkpoint."""
    path = Path(path)
    if _TRUSTED.get():
        return torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except (ValueError, RuntimeError, pickle.UnpicklingError):  # not a zip checkpoint: torch.load says what it holds
        names = []
    allowed = [_allowed(name, path, own_types) for name in names]
    with torch.serialization.safe_globals(allowed):
        try:
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as e:  # a global built at load time, which the static scan above cannot see
            found = re.search(r"GLOBAL ([\w.]+)", str(e))
            raise UserError(_refusal(path, found.group(1) if found else "a type it does not name")) from None


class _MetadataUnpickler(pickle.Unpickler):
    """pickle's own unpickler, restricted to DCP_METADATA_TYPES and torch's dtypes (the pickle documentation's
    "Restricting Globals"): torch's weights_only reader does not read the pickle protocol DCP writes."""

    def __init__(self, file: Any, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if f"{module}.{name}" in DCP_METADATA_TYPES or dtype:
            return super().find_class(module, name)
        raise UserError(_refusal(self.path, f"{module}.{name}"))


def vet_files(target: Path, rank: int = 0, world: int = 1) -> None:
    """Every .pt file under `target` read as read_file reads it (mapped, not copied), and a DCP directory's .metadata
    with its few types, before a reader that unpickles them as they are (DeepSpeed's, DCP's) sees them; a no-op when
    the user trusts the checkpoint. On a resume each rank vets every world-th file (the ranks then agree: the files
    are the ones store.verify_files found whole on every rank)."""
    if _TRUSTED.get():
        return
    files = sorted(target.rglob("*.pt")) + sorted(target.rglob(".metadata"))
    for path in files[rank::max(world, 1)]:
        if path.suffix == ".pt":
            read_file(path, own_types=path.parent.name == ck.RANK_STATE_DIR, mmap=True)
        else:
            with open(path, "rb") as f:
                _MetadataUnpickler(f, path).load()


# --- saving: the commit protocol ----------------------------------------------------------------
def own_writes(rank: int, write: Callable[[], Any]) -> tuple[Any, Optional[BaseException]]:
    """(write()'s result, None), or (None, the error) when it raised an environment fault (an OSError, on this
    rank or, for DCP, on any: async_save.write_error_text); anything else is raised as it is."""
    try:
        return write(), None
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if not isinstance(e, Exception) and getattr(e, "failures", None) is None:
            raise
        if write_error_text(e, rank) is None:
            raise
        return None, e


@dataclass
class CheckpointExtras:
    """What a checkpoint holds beside the backend's shards and the client state: the trainer's, given to every
    Engine.save_checkpoint."""

    tokenizer: Any = None
    """Saved with the HF config inside every checkpoint, so an export is self-contained (a processor: with it)."""
    data_record: dict[str, Any] = field(default_factory=dict)
    """What the data pipeline was (its text packing, global batch, a mixture's record), so a resume prepares the same
    data (checkpoint.store.data_record)."""
    rank_state: Optional[Callable[[], Any]] = None
    """Each rank's own state beyond the backend's (online RL's generation batch in flight): called at each save and
    written as ck.rank_state_file(rank); Loaded.rank_state gives it back on the same world size."""


class Loaded(NamedTuple):
    """Engine.load_checkpoint's result."""

    client_state: dict[str, Any]
    """The client state given at save time."""
    rank_state: Any
    """This rank's CheckpointExtras.rank_state from the checkpoint (None: none saved, or saved on another world
    size)."""


def meta(engine: Any, extras: CheckpointExtras) -> ck.CheckpointMeta:
    """What the checkpoint's meta records: the run's identity, its data record, the backend's layout."""
    out = engine.identity().meta(engine.global_step)
    if extras.data_record:
        out.extra["data"] = dict(extras.data_record)
    out.extra.update(engine._layout_record())
    if extras.rank_state is not None:
        out.extra["rank_state"] = True
    return out


def _write_rank0_files(engine: Any, target: Path, tokenizer: Any) -> None:
    """Rank 0: the HF config, tokenizer (and LoRA adapter config) inside the checkpoint (export needs them)."""
    ck.save_model_files(target, engine.hf_model, tokenizer)
    if engine.uses_lora:  # export rebuilds the peft model from it
        engine.hf_model.peft_config["default"].save_pretrained(str(target))


def _write_rank_state(engine: Any, target: Path, rank_state: Optional[Callable[[], Any]]) -> None:
    """This rank's rank_state (when the run has one) into the tag dir, before its shards (a small file, written
    in the calling thread also under --async-save: it is what this step holds, not what the writer copies)."""
    if rank_state is None:
        return
    path = target / ck.rank_state_file(engine.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(rank_state(), path)


def save(engine: Any, root: Path, client_state: dict[str, Any], extras: CheckpointExtras) -> Path:
    """Engine.save_checkpoint: this rank's files, then settled now, or (--async-save) once committed later."""
    finish_pending(engine)  # at most one save in flight
    target, done = ck.prepare_save(root, engine.global_step, engine.is_main)
    if done:
        return target
    record = meta(engine, extras)
    asynchronous = engine.cfg.run.async_save
    shards = engine._write_shards_async if asynchronous else engine._write_shards
    ticket, error = own_writes(engine.rank, lambda: _write_rank_state(engine, target, extras.rank_state)
                               or shards(target, dict(client_state)))
    if engine.is_main and error is None:
        _, error = own_writes(engine.rank, lambda: _write_rank0_files(engine, target, extras.tokenizer))
    if asynchronous:
        if error is not None:  # this rank's part failed before its writer got it: known now
            ticket = Ticket()
            ticket.finish(error)
        engine.pending_save = PendingSave(root, target, record, ticket, time.monotonic())
        return target
    _settle(engine, root, target, record, None if error is None else write_error_text(error, engine.rank))
    return target


def _settle(engine: Any, root: Path, target: Path, record: ck.CheckpointMeta, error: Optional[str],
            gather: bool = True) -> Optional[ck.SaveFailure]:
    """Every rank, once every rank stopped writing `target` (error: this rank's OSError line, "" when only
    another rank's failed; gather=False: every rank agreed none failed). Every rank's result is gathered;
    rank 0 commits when all wrote and every file of ck.expected_files is there, else removes the tag
    (`latest` stays); every rank learns which. Returns the failure (also appended to save_failures)."""
    from ..distributed.collectives import is_distributed

    lines = [error]
    if gather and is_distributed():  # every rank's result, in place of a barrier after the writes
        import torch.distributed as tdist

        lines = [None] * engine.world_size
        tdist.all_gather_object(lines, error)
    failed = [f"rank {r}: {line}" for r, line in enumerate(lines) if line]
    outcome: list[Optional[str]] = [None]
    if engine.is_main:
        if not failed:
            missing = ck.missing_files(target, record)
            if missing:
                failed = [f"{missing[0]} is not there for rank 0 ({len(missing)} of the files every rank writes "
                          "missing, though no rank reported a failed write: --output must be on a file system "
                          "every host sees at the same path, since a resume reads every rank's files)"]
        if not failed:
            _, e = own_writes(0, lambda: ck.commit(root, target.name, record, engine.cfg.run.keep_last))
            failed = [] if e is None else [f"rank 0: {write_error_text(e, 0)}"]
        if failed:
            outcome = ["; ".join(failed)]
            with contextlib.suppress(OSError):  # never committed: no tag name left (a leftover goes at prune)
                ck.remove_tag(target)
    if is_distributed():  # every rank learns the outcome, in place of a barrier after the commit
        import torch.distributed as tdist

        tdist.broadcast_object_list(outcome, src=0)
    if outcome[0] is None:
        engine.failed_saves_in_row = 0
        return None
    engine.failed_saves_in_row += 1
    failure = ck.SaveFailure(record.global_step, target, outcome[0], ck.newest_complete(root),
                             engine.failed_saves_in_row)
    engine.save_failures.append(failure)
    return failure


def commit_pending(engine: Any, any_failed: Optional[bool] = None) -> Optional[PendingSave]:
    """Engine.commit_pending_save: settle the save in flight, once no rank's write of it is running."""
    pending, engine.pending_save = engine.pending_save, None
    if pending is None:
        return None
    own = pending.ticket.result()
    line = None if own is None else write_error_text(own, engine.rank)
    if own is not None and line is None:
        pending.ticket.wait()  # not an environment fault: raised as it is
    failure = _settle(engine, pending.root, pending.target, pending.meta, line, gather=any_failed is not False)
    return pending if failure is None else None


def finish_pending(engine: Any) -> Optional[PendingSave]:
    """Engine.finish_pending_save: wait for this rank's write of the save in flight, then settle it; returns it when
    committed."""
    if engine.pending_save is None:
        return None
    with contextlib.suppress(Exception):
        engine.pending_save.ticket.wait()  # its error is read by commit_pending
    return commit_pending(engine)


# --- resuming ------------------------------------------------------------------------------------
def load(engine: Any, path: str | Path) -> Loaded:
    """Engine.load_checkpoint: the resume checks, every file vetted (unless trusted), the backend's shards read, and
    this rank's rank state when the checkpoint holds one written on this world size."""
    target = ck.resolve_checkpoint(path)
    record = ck.read_meta(target)
    ck.check_resume(record, target, engine.identity())
    # each rank checks, then vets, every world-th file, agreed: a damaged or unsafe file is named once, by the rank
    # that read it, and the others stop as its peers
    agree(lambda: ck.verify_files(target, record, engine.rank, engine.world_size), f"--resume {target}")
    with trusting(engine.cfg.run.trust_checkpoint):
        agree(lambda: vet_files(target, engine.rank, engine.world_size), f"--resume {target}")
        client_state = engine._read_shards(target, record)
        engine.micro_step = engine.global_step * engine.grad_accum  # resume on an accumulation boundary
        own = target / ck.rank_state_file(engine.rank)
        rank_state = None
        if record.extra.get("rank_state") and record.world_size == engine.world_size and own.is_file():
            rank_state = read_file(own, own_types=True)
    return Loaded(client_state, rank_state)
