"""Checkpoint bookkeeping shared by both backends: tags, the atomic `latest` pointer, completeness,
pruning, per-checkpoint meta, and resume resolution.

Layout (the `deepspeed` format's backend files are DeepSpeed's native ones, which
`deepspeed.utils.zero_to_fp32` reads):

    CKPT_ROOT/                  usually RUN_OUTPUT/checkpoints
      latest                    text file naming the newest COMPLETE tag (written atomically)
      global_step6/             one checkpoint (a tag)
        zerotrain_meta.json     written last, by rank 0, after every rank finished: marks it complete
        config.json             the model's HF config (so `zerotrain export` needs nothing else)
        tokenizer files         if the trainer gave a tokenizer
        ...                     backend files, by CheckpointMeta.format: deepspeed: DeepSpeed's
                                *_model_states.pt / *_optim_states.pt; deepspeed-pipe: DeepSpeed's
                                pipeline layout, one layer_XX-model_states.pt per layer (written by the
                                stage that holds it) beside its mp_rank/optimizer files; dcp (both FSDP
                                engines): a torch.distributed.checkpoint directory `dcp/`

Commit protocol ("never lost"): every rank writes its shards -> every rank's write result is agreed
(zerotrain/backends/checkpointing.py _settle) -> when every rank wrote and every file of expected_files is
there, rank 0 writes zerotrain_meta.json, then `latest` (temp file + os.replace), then deletes tags beyond
keep_last; when any rank failed (a full disk), rank 0 removes the tag (remove_tag) and `latest` stays -> every
rank learns the outcome. A crash before the meta file leaves an incomplete tag that is never resumed from and
`latest` still names the previous complete checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from ..errors import UserError

META_FILE = "zerotrain_meta.json"
LATEST_FILE = "latest"
CHECKPOINTS_DIR = "checkpoints"
DCP_SUBDIR = "dcp"
"""FSDP backend: the torch.distributed.checkpoint directory inside a tag (model + optimizer)."""
ENGINE_STATE = "engine_state.pt"
"""FSDP backend: what rank 0 saves beside the DCP directory (scheduler, global step, client state)."""
MAX_FAILED_SAVES = 3
"""Checkpoint saves in a row that may fail (a rank's write raised OSError, e.g. a full disk) before the run stops:
each failed one is removed and warned about while training goes on from memory; the third in a row stops the run
in one line naming the last complete checkpoint (docs/training.md)."""
_REMOVING = ".removing-"
"""Prefix a tag dir is renamed to before it is deleted (remove_tag): a crash mid-removal leaves no tag name."""
_TAG_RE = re.compile(r"^global_step(\d+)$")
RANK_STATE_DIR = "rank_state"
"""Under a tag dir: what each rank adds beside the backend's state (CheckpointExtras.rank_state, backends/checkpointing.py: online RL's generation batch
in flight), one rank<R>.pt per rank; expected_files wants them when meta.extra["rank_state"] says the run had one."""


def rank_state_file(rank: int) -> str:
    """A rank's CheckpointExtras.rank_state file, relative to the tag dir."""
    return f"{RANK_STATE_DIR}/rank{rank}.pt"


def tag_for(global_step: int) -> str:
    """DeepSpeed's default tag name for a step."""
    return f"global_step{global_step}"


def step_of(tag: str) -> Optional[int]:
    m = _TAG_RE.match(tag)
    return int(m.group(1)) if m else None


def write_atomic(path: str | Path, text: str) -> None:
    """Write a small file so readers see the old or the new content, never a partial one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --- meta -------------------------------------------------------------------------------------

@dataclass
class CheckpointMeta:
    """What a checkpoint is, so resume/export can refuse a mismatch with a clear error."""

    backend: str
    """'deepspeed' or 'fsdp'."""
    format: str
    """'deepspeed' (native ZeRO files), 'deepspeed-pipe' (DeepSpeed's pipeline engine: layer_XX files) or
    'dcp' (torch.distributed.checkpoint under dcp/); which engine writes which: plan/registry.py."""
    zero_stage: int
    world_size: int
    dtype: str
    model_class: str
    """Class name of the trained module, e.g. GPT2LMHeadModel."""
    model_config_hash: str
    """config_hash() of the HF config (or of the parameter shapes for non-HF models)."""
    global_step: int
    extra: dict[str, Any] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)
    """Every file of the checkpoint (path relative to its tag dir -> bytes) as the save left it, recorded
    at commit; resume compares before any rank loads (verify_files). Empty in checkpoints written before."""


def write_meta(ckpt_dir: str | Path, meta: CheckpointMeta) -> None:
    write_atomic(Path(ckpt_dir) / META_FILE, json.dumps(asdict(meta), indent=2, sort_keys=True) + "\n")


def read_meta(ckpt_dir: str | Path) -> CheckpointMeta:
    p = Path(ckpt_dir) / META_FILE
    if not p.is_file():
        raise UserError(f"{ckpt_dir}: not a complete zerotrain checkpoint (no {META_FILE}); "
                        "pass a checkpoint directory written by zerotrain")
    return CheckpointMeta(**json.loads(p.read_text()))


def data_record(ckpt_dir: str | Path) -> dict[str, Any]:
    """What the checkpoint records about the run's data pipeline (CheckpointMeta.extra["data"], written from
    CheckpointExtras.data_record); a checkpoint from before the record packed plain text per 1000-text batch (version 1)."""
    return {"text_packing": 1, **read_meta(ckpt_dir).extra.get("data", {})}


def file_sizes(ckpt_dir: Path) -> dict[str, int]:
    """Relative path -> size of every file under a checkpoint dir (the meta file excluded)."""
    return {p.relative_to(ckpt_dir).as_posix(): p.stat().st_size
            for p in sorted(ckpt_dir.rglob("*")) if p.is_file() and p.name != META_FILE}


def expected_files(meta: CheckpointMeta) -> list[str]:
    """The backend files every rank must have written into a tag dir (relative paths), by format and layout: the
    names DeepSpeed 0.19 and torch.distributed.checkpoint write (seen in real 2-rank checkpoint dirs). Checked at
    commit (a save missing one is not committed) and before any backend load (verify_files).

    dcp: `dcp/.metadata` (the coordinator's, written last) and `dcp/__R_0.distcp` for every rank R, plus rank 0's
    engine_state.pt. deepspeed (dp data-parallel x tp ranks; `bf16_` before `zero_pp_rank` in bf16): ZeRO-3 one
    `zero_pp_rank_D_mp_rank_TT_model_states.pt` per rank, else `mp_rank_TT_model_states.pt` per tp rank; ZeRO 1-3
    and bf16 (DeepSpeed's BF16_Optimizer) `zero_pp_rank_D_mp_rank_TT_optim_states.pt` per rank. deepspeed-pipe:
    `layer_XX-model_states.pt` for every layer with state (extra["pipe_layers"]), `mp_rank_SS_model_states.pt`
    per stage and the optimizer files per rank as above. Any format: rank_state/rank<R>.pt per rank when the run
    has a CheckpointExtras.rank_state."""
    if meta.format == "dcp":
        shards = [f"{DCP_SUBDIR}/__{r}_0.distcp" for r in range(meta.world_size)]
        return [ENGINE_STATE, f"{DCP_SUBDIR}/.metadata", *shards, *_rank_state_files(meta)]
    from ..distributed.layout import WorldLayout

    layout = WorldLayout(meta.world_size, tp=meta.extra.get("tp", 1), pp=meta.extra.get("pp", 1))
    mp, dp = layout.model_parallel, layout.dp  # DeepSpeed's mp rank: the pipeline stage (deepspeed-pipe) or tp rank
    bf16 = "bf16_" if meta.dtype == "bf16" else ""
    names: list[str] = []
    if meta.format == "deepspeed-pipe":
        names += [f"layer_{i:02d}-model_states.pt" for i in meta.extra.get("pipe_layers", [])]
    if meta.zero_stage == 3:
        names += [f"zero_pp_rank_{d}_mp_rank_{m:02d}_model_states.pt" for m in range(mp) for d in range(dp)]
    else:
        names += [f"mp_rank_{m:02d}_model_states.pt" for m in range(mp)]
    if meta.zero_stage > 0 or bf16:
        names += [f"{bf16}zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt" for m in range(mp) for d in range(dp)]
    return names + _rank_state_files(meta)


def _rank_state_files(meta: CheckpointMeta) -> list[str]:
    return [rank_state_file(r) for r in range(meta.world_size)] if meta.extra.get("rank_state") else []


def missing_files(ckpt_dir: str | Path, meta: CheckpointMeta) -> list[str]:
    """The expected_files not in ckpt_dir (rank 0 at commit: a save missing any is not committed)."""
    root = Path(ckpt_dir)
    return [rel for rel in expected_files(meta) if not (root / rel).is_file()]


def verify_files(ckpt_dir: str | Path, meta: CheckpointMeta, rank: int = 0, world: int = 1) -> None:
    """Refuse a checkpoint missing a file every rank must have written (expected_files) or one the save recorded,
    with a file shorter than at the save (not longer: a shared file system may have shown rank 0 stale sizes), or
    a torch file with no readable zip directory, before any backend load: loads have collectives inside, so one
    rank failing halfway leaves the others waiting. Each rank checks every world-th file (a damaged one is named
    once, by one rank)."""
    import zipfile

    root = Path(ckpt_dir)
    fix = f"the checkpoint was changed or damaged after its save; resume from an earlier one under {root.parent}"
    names = sorted(set(meta.files) | set(expected_files(meta))
                   | {p.relative_to(root).as_posix() for p in root.rglob("*.pt") if p.is_file()})
    for rel in names[rank::max(world, 1)]:
        p = root / rel
        if not p.is_file():
            raise UserError(f"{root}: {rel} is missing ({fix})")
        if rel in meta.files and p.stat().st_size < meta.files[rel]:
            raise UserError(f"{root}: {rel} has {p.stat().st_size} bytes, the save wrote {meta.files[rel]} ({fix})")
        if p.suffix == ".pt":
            try:
                with zipfile.ZipFile(p):
                    pass
            except (zipfile.BadZipFile, OSError) as e:
                raise UserError(f"{root}: {rel} is not a readable torch file ({e}; {fix})") from e


def is_complete(ckpt_dir: str | Path) -> bool:
    return (Path(ckpt_dir) / META_FILE).is_file()


def prepare_save(ckpt_root: str | Path, step: int, is_main: bool) -> tuple[Path, bool]:
    """(checkpoint dir for `step`, whether it is already complete). Call on every rank before saving.

    A complete one is kept (e.g. a save right after resume). Rank 0 removes the leftover of an
    interrupted save of this very step, and a barrier keeps every rank from writing into it before.
    """
    from ..distributed import process_group as dist

    target = Path(ckpt_root) / tag_for(step)
    if is_complete(target):
        return target, True
    if is_main and target.exists():
        shutil.rmtree(target)
    dist.barrier()
    return target, False


def config_hash(model: Any) -> tuple[str, str]:
    """(class name, short hash) identifying a model's architecture, stable across runs and stages.

    HF models hash their config (minus fields that do not change weights' meaning); others hash
    parameter names (shapes are partitioned under ZeRO-3 so they are not used).
    """
    cls = type(model).__name__
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "to_dict"):
        d = {k: v for k, v in cfg.to_dict().items()
             if k not in ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures",
                          "use_cache", "_attn_implementation_autoset", "_commit_hash")}
        blob = json.dumps(d, sort_keys=True, default=str)
    else:
        blob = json.dumps(sorted(n for n, _ in model.named_parameters()))
    return cls, hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RunIdentity:
    """What a run is, as its checkpoints record it (CheckpointMeta) and as a resume must match it:
    one record built from the plan (identity_of), written by the engine and checked by check_resume."""

    backend: str
    """deepspeed or fsdp."""
    format: str
    """The checkpoint format the run's engine writes (plan/registry.py)."""
    world_size: int
    zero_stage: int
    """The stage the backend runs (plan.sharding.effective_stage)."""
    dtype: str
    tp: int
    pp: int
    nvme_optimizer: bool
    """Optimizer states offloaded to NVMe (DeepSpeed then skips its universal-checkpoint load)."""
    model_id: tuple[str, str]
    """(class name, config_hash) of the model."""
    lora: Optional[dict[str, Any]] = None
    """lora.identity_of: the adapter's base (path, weights hash) and shape; None without LoRA."""
    quant: Optional[dict[str, Any]] = None
    """{"scheme", "group_size"} of a QAT run; None without QAT."""
    freeze: tuple[str, ...] = ()
    """Image-text models: the --freeze roles (sorted); a resume with others would give parameters that never had
    optimizer state a fresh one, or none to what had."""
    optimizer: str = "adamw"
    """optimizer.name: the optimizer whose state the checkpoint holds (another one cannot read it)."""

    def extra(self) -> dict[str, Any]:
        """CheckpointMeta.extra: the layout beyond data parallelism, the adapter, the QAT scheme."""
        out: dict[str, Any] = {k: v for k, v in (("tp", self.tp), ("pp", self.pp)) if v > 1}
        if self.lora is not None:
            out["lora"] = self.lora
        if self.quant is not None:  # export --quantize converts with the same scheme and group size
            out["quant"] = self.quant
        if self.freeze:
            out["freeze"] = list(self.freeze)
        out["optimizer"] = self.optimizer
        return out

    def meta(self, global_step: int) -> CheckpointMeta:
        cls, h = self.model_id
        return CheckpointMeta(backend=self.backend, format=self.format, zero_stage=self.zero_stage,
                              world_size=self.world_size, dtype=self.dtype, model_class=cls, model_config_hash=h,
                              global_step=global_step, extra=self.extra())


def identity_of(plan: Any, model_id: tuple[str, str], lora_base: Optional[str]) -> RunIdentity:
    """The identity of a planned run (a RunPlan with its world) and its model; LoRA's and QAT's records
    are the plan's preparation's (lora_base: where a LoRA run's base weights come from; unused without LoRA)."""
    prep = plan.preparation
    return RunIdentity(backend=plan.backend, format=plan.checkpoint_format, world_size=plan.world.world_size,
                       zero_stage=plan.sharding.effective_stage, dtype=plan.dtype, tp=plan.world.tp,
                       pp=plan.world.pp, nvme_optimizer=plan.sharding.offload_optimizer == "nvme",
                       model_id=model_id, lora=prep.lora_record(lora_base), quant=prep.qat_record(),
                       freeze=tuple(sorted(prep.freeze)), optimizer=plan.cfg.optimizer.name)


def check_resume(meta: CheckpointMeta, ckpt_dir: str | Path, now: RunIdentity) -> None:
    """The one resume-compatibility check (before launch in preflight and in Engine.load_checkpoint, with
    the same identity): backend and format, model, LoRA adapter and base, --freeze, optimizer, QAT scheme, then the layout
    (world size, stage, tp, pp). Each refusal is one line naming the flag that makes it resume."""
    if meta.backend != now.backend:
        raise UserError(f"--resume {ckpt_dir}: checkpoint was written by the {meta.backend} backend; resume with "
                        f"--backend {meta.backend}, or `zerotrain export` it and start from the HF dir")
    _refuse_other_model(meta, now.model_id, ckpt_dir)
    check_lora_resume(meta.extra, now.lora, ckpt_dir)
    was_frozen, now_frozen = ",".join(meta.extra.get("freeze", [])), ",".join(now.freeze)
    if was_frozen != now_frozen:
        raise UserError(f"--resume {ckpt_dir}: the checkpoint was trained with --freeze {was_frozen or '(none)'}, this "
                        f"run {now_frozen or '(none)'}; resume with "
                        + (f"--freeze {was_frozen}" if was_frozen else "no --freeze"))
    saved_optimizer = meta.extra.get("optimizer")  # absent from checkpoints written before it was recorded
    if saved_optimizer is not None and saved_optimizer != now.optimizer:
        raise UserError(f"--resume {ckpt_dir}: the checkpoint holds {saved_optimizer}'s optimizer state, this run's "
                        f"--optimizer is {now.optimizer}; resume with --optimizer {saved_optimizer}, or `zerotrain "
                        f"export` it and start {now.optimizer} from the HF dir")
    saved_quant = meta.extra.get("quant")
    if saved_quant != now.quant:
        was = (f"--qat {saved_quant['scheme']} --quant-group-size {saved_quant['group_size']}" if saved_quant
               else "--qat none")
        raise UserError(f"{ckpt_dir}: trained with {was}; resume with the same flags (the fake-quantized "
                        "forward is part of the trajectory)")
    check_layout(meta, ckpt_dir, now.world_size, now.zero_stage, nvme_optimizer=now.nvme_optimizer, tp=now.tp,
                 pp=now.pp)
    if meta.format != now.format:  # same backend and layout: a checkpoint of another zerotrain version
        raise UserError(f"--resume {ckpt_dir}: a {meta.format} checkpoint, this run writes {now.format}; "
                        "`zerotrain export` it and start from the HF dir")


def check_lora_resume(meta_extra: dict[str, Any], now: Optional[dict[str, Any]], ckpt_dir: str | Path) -> None:
    """Refuse to resume a LoRA checkpoint without LoRA, on another base, or with another adapter shape."""
    was = meta_extra.get("lora")
    if was is None and now is None:
        return
    if was is None or now is None:
        how = "without LoRA" if was is None else f"with LoRA r={was['r']}"
        fix = "--lora-r 0" if was is None else f"--lora-r {was['r']} --lora-targets {was['targets']}"
        raise UserError(f"--resume {ckpt_dir}: the checkpoint was trained {how}; resume with {fix}")
    if was["base_hash"] != now["base_hash"]:
        raise UserError(f"--resume {ckpt_dir}: the adapter was trained on base {was['base']} ({was['base_hash']}), "
                        f"this run loads {now['base']} ({now['base_hash']}); resume with --model {was['base']}")
    for key, flag in (("r", "--lora-r"), ("alpha", "--lora-alpha"), ("targets", "--lora-targets"),
                      ("scope", "--lora-scope")):
        had, has = was.get(key), now.get(key)
        if key == "scope":  # not set is the default scope (language), and a text-only model sets none
            had, has = had or "language", has or "language"
        if had != has:
            raise UserError(f"--resume {ckpt_dir}: the adapter has {flag} {had}, this run {has}; "
                            f"resume with {flag} {had}")


def needs_universal(meta: CheckpointMeta, world: int, stage: int) -> bool:
    """A `deepspeed`-format checkpoint resumed on another world size or stage goes through DeepSpeed's
    universal format, except fp32 stage 0, whose state every rank holds whole (a plain load); a
    deepspeed-pipe or dcp one never does."""
    if meta.format != "deepspeed" or (meta.world_size, meta.zero_stage) == (world, stage):
        return False
    return not (meta.zero_stage == stage == 0 and meta.dtype == "fp32")


def check_layout(meta: CheckpointMeta, ckpt_dir: str | Path, world: int, stage: int,
                 nvme_optimizer: bool = False, tp: int = 1, pp: int = 1) -> None:
    """Refuse a world-size / ZeRO-stage change the checkpoint's format cannot follow (one-line ValueError).

    dcp (FSDP): torch.distributed.checkpoint reshards to any world size and stage. deepspeed: any
    world size within stage 0 (fp32), within stages 1-2 and within stage 3 (DeepSpeed's universal
    checkpoint conversion); its converter cannot cross between those groups. deepspeed-pipe (and any
    tp or pp > 1): the same world size and stage only. DeepSpeed skips the universal load altogether
    when the optimizer is offloaded to NVMe (nvme_optimizer).
    """
    for kind, name, now in (("tp", "tensor-parallel", tp), ("pp", "pipeline-parallel", pp)):
        was = meta.extra.get(kind, 1)
        if was != now:
            raise UserError(f"--resume {ckpt_dir}: written with {name} {was}, this run has --{kind} {now}; resume "
                            f"with --{kind} {was}, or `zerotrain export` it and start from the HF dir")
    if meta.format == "dcp" or (meta.world_size, meta.zero_stage) == (world, stage):
        return
    if max(tp, pp) > 1:
        raise UserError(f"--resume {ckpt_dir}: written by {meta.world_size} ranks with --tp {tp} --pp {pp}, this run "
                        f"has {world} ranks at stage {stage}; DeepSpeed's universal checkpoint conversion does not "
                        f"convert tensor/pipeline-parallel checkpoints: resume on {meta.world_size} ranks at --stage "
                        f"{meta.zero_stage}, or `zerotrain export` it and start from the HF dir")
    head = (f"--resume {ckpt_dir}: written by {meta.world_size} ranks at ZeRO stage {meta.zero_stage}, this run has "
            f"{world} ranks at stage {stage}")
    group = {0: "0", 1: "1-2", 2: "1-2", 3: "3"}
    if stage != 0 and group[meta.zero_stage] == group[stage]:
        if nvme_optimizer:
            raise UserError(f"{head}; DeepSpeed does not load a converted (universal) checkpoint with "
                            "--offload-optimizer nvme: resume with --offload-optimizer cpu, or on "
                            f"{meta.world_size} ranks at --stage {meta.zero_stage}")
        return
    if meta.zero_stage == stage == 0 and meta.dtype == "fp32":
        return
    if meta.zero_stage == stage == 0:
        why = f"DeepSpeed's stage-0 {meta.dtype} optimizer state is partitioned and has no universal loader"
    else:
        why = (f"DeepSpeed converts between world sizes within stages 1-2 and within stage 3, not from stage "
               f"{meta.zero_stage} to {stage}")
    raise UserError(f"{head}; {why}: resume with --stage {meta.zero_stage}"
                    f"{'' if meta.zero_stage else f' on {meta.world_size} ranks'}, or `zerotrain export` it and "
                    "start from the HF dir")


def _refuse_other_model(meta: CheckpointMeta, model_id: tuple[str, str], ckpt_dir: str | Path) -> None:
    cls, h = model_id
    if (meta.model_class, meta.model_config_hash) != (cls, h):
        raise UserError(f"--resume {ckpt_dir}: checkpoint is of {meta.model_class} (config {meta.model_config_hash}) "
                        f"but the run builds {cls} (config {h}); resume with the same --model/--model-config "
                        "or start without --resume")


@dataclass
class SaveFailure:
    """A checkpoint save that did not become `latest`: a rank's write raised an OSError (a full disk), or a file
    every rank must write was missing at commit. Its tag dir was removed; the run goes on from memory."""

    step: int
    """The global step it held."""
    path: Path
    """The tag dir (removed)."""
    line: str
    """What failed, one line per cause: "rank 1: [Errno 28] No space left on device: 'FILE'"."""
    last_complete: Optional[Path]
    """The newest complete checkpoint (what `latest` names), None when there is none."""
    in_a_row: int
    """Failed saves since the last committed one, this one included."""

    def warning(self) -> str:
        kept = f"`latest` stays at {self.last_complete}" if self.last_complete else "no complete checkpoint yet"
        return (f"checkpoint {self.path} was not saved ({self.line}); removed it, {kept}; training goes on "
                f"({self.in_a_row} of {MAX_FAILED_SAVES} failed saves in a row stop the run): free space there "
                "or pass another --output")

    def record(self) -> dict[str, Any]:
        """metrics.jsonl's record of it."""
        return {"event": "checkpoint_failed", "step": self.step, "path": str(self.path), "error": self.line,
                "last_complete": None if self.last_complete is None else str(self.last_complete),
                "in_a_row": self.in_a_row}


# --- the latest pointer and the list of checkpoints --------------------------------------------

def read_latest(ckpt_root: str | Path) -> Optional[str]:
    p = Path(ckpt_root) / LATEST_FILE
    if not p.is_file():
        return None
    tag = p.read_text().strip()
    return tag or None


def write_latest(ckpt_root: str | Path, tag: str) -> None:
    write_atomic(Path(ckpt_root) / LATEST_FILE, tag)


def list_complete(ckpt_root: str | Path) -> list[Path]:
    """Complete checkpoint dirs under ckpt_root, oldest first (by step)."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = [(step_of(d.name), d) for d in root.iterdir() if d.is_dir() and step_of(d.name) is not None]
    return [d for s, d in sorted(found) if is_complete(d)]


def remove_tag(ckpt_dir: str | Path) -> None:
    """Delete a tag dir so that no crash leaves it looking like a checkpoint: renamed out of the tag names first
    (one atomic rename), then deleted; a leftover of a crash mid-removal is deleted by the next prune."""
    d = Path(ckpt_dir)
    if not d.exists():
        return
    aside = d.with_name(f"{_REMOVING}{d.name}")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(d, aside)
    shutil.rmtree(aside, ignore_errors=True)


def prune(ckpt_root: str | Path, keep_last: int, protect: str) -> list[Path]:
    """Delete all but the newest keep_last complete checkpoints (a failed save, never committed, is not one of
    them), plus incomplete tags older than the newest complete one (crash leftovers) and removals a crash
    interrupted (remove_tag). Never deletes `protect` (the one just committed)."""
    root = Path(ckpt_root)
    complete = list_complete(root)
    newest = step_of(complete[-1].name) if complete else None
    doomed = [d for d in complete[:-keep_last] if d.name != protect] if keep_last > 0 else []
    if newest is not None:
        doomed += [d for d in root.iterdir() if d.is_dir() and step_of(d.name) is not None
                   and not is_complete(d) and step_of(d.name) < newest and d.name != protect]
    for d in doomed:
        remove_tag(d)
    for d in root.glob(f"{_REMOVING}*"):
        shutil.rmtree(d, ignore_errors=True)
    return doomed


def commit(ckpt_root: str | Path, tag: str, meta: CheckpointMeta, keep_last: int) -> None:
    """Rank 0 only, after a barrier that follows every rank's writes: record the files, mark complete,
    point latest, prune."""
    meta = replace(meta, files=file_sizes(Path(ckpt_root) / tag))
    write_meta(Path(ckpt_root) / tag, meta)
    write_latest(ckpt_root, tag)
    prune(ckpt_root, keep_last, protect=tag)


def save_model_files(ckpt_dir: str | Path, model: Any, tokenizer: Any = None) -> None:
    """Rank 0: the HF config (and tokenizer) inside the checkpoint, so export needs nothing else."""
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "save_pretrained"):
        cfg.save_pretrained(str(ckpt_dir))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(ckpt_dir))


def write_hf_dir(out: Path, model: Any, state_dict: Optional[dict] = None, tokenizer: Any = None) -> Path:
    """A HF save_pretrained directory (safetensors) of `model`, with `state_dict` as its weights when
    given (a gathered copy of a sharded model), and the tokenizer (or the tokenizer files of a
    checkpoint dir, when a path is given)."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), state_dict=state_dict, safe_serialization=True)
    write_tokenizer(out, tokenizer)
    return out


def write_tokenizer(out: Path, tokenizer: Any) -> None:
    """Save a tokenizer into `out`: a tokenizer object, or the tokenizer files of a directory (a
    checkpoint's, which holds them so export is self-contained; none there: nothing written)."""
    if isinstance(tokenizer, (str, Path)):
        if not (Path(tokenizer) / "tokenizer_config.json").is_file():
            return
        from transformers import AutoProcessor, AutoTokenizer

        # an image-text model's checkpoint holds its processor (image processor, chat template): export it whole
        auto = AutoProcessor if (Path(tokenizer) / "processor_config.json").is_file() else AutoTokenizer
        tokenizer = auto.from_pretrained(str(tokenizer))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))


# --- resume -------------------------------------------------------------------------------------

def newest_complete(ckpt_root: str | Path) -> Optional[Path]:
    """The checkpoint to resume from under a checkpoints/ root: its `latest` when that one is complete,
    else the newest complete one (`latest` missing or stale: a crash between meta and pointer); None."""
    root = Path(ckpt_root)
    tag = read_latest(root)
    if tag is not None and is_complete(root / tag):
        return root / tag
    complete = list_complete(root)
    return complete[-1] if complete else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint root (use its `latest`) or one tag dir -> the complete tag dir to load."""
    p = Path(path)
    if is_complete(p):
        return p
    if (p / CHECKPOINTS_DIR).is_dir() and not (p / LATEST_FILE).exists():
        p = p / CHECKPOINTS_DIR  # a run output dir
    found = newest_complete(p)
    if found is not None:
        return found
    if p.is_dir() and step_of(p.name) is not None:
        raise UserError(f"{p}: checkpoint is incomplete (no {META_FILE}; a save was interrupted); "
                        f"resume from {p.parent} to use the newest complete one")
    raise UserError(f"{p}: no complete checkpoint found; pass a checkpoint directory or a run's checkpoints/ dir")


def resolve_resume(output_dir: str | Path, resume: Optional[str]) -> Optional[Path]:
    """--resume value -> the complete checkpoint dir to load (None when not resuming).

    'latest' means the newest complete checkpoint in OUTPUT/checkpoints; 'auto' the same, or None (a fresh
    start) when there is none: what a restarted worker group needs (zerotrain launch --elastic). Anything else
    is a path.
    """
    if not resume:
        return None
    if resume in ("latest", "auto"):
        root = Path(output_dir) / CHECKPOINTS_DIR
        found = newest_complete(root)
        if found is None and resume == "latest":
            raise UserError(f"--resume: no complete checkpoint in {root}; start without --resume "
                            "(or pass --resume auto: resume when there is one, start fresh when not)")
        return found
    p = Path(resume)
    if not p.exists():
        raise UserError(f"--resume {resume}: no such directory; pass a checkpoint dir or 'latest'")
    try:
        return resolve_checkpoint(p)
    except ValueError as e:
        raise UserError(f"--resume {e}") from None
