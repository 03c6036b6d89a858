"""`zerotrain export` of a LoRA checkpoint: the adapter (and the merged model) in one process.

Apart from zerotrain/model/lora.py (which the backends import) because it reads either backend's checkpoint
files, through the reader plan/registry.py names for the checkpoint's format.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import UserError


def export_adapter(ckpt_dir: Path, out: Path, merge: bool) -> Path:
    """A LoRA checkpoint of either backend -> peft adapter files in `out` (+ out/merged with `merge`),
    in one process: the base is loaded from where the checkpoint says (and must still hash the same),
    the trained adapters from the checkpoint's shards."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig

    from ..checkpoint import store as ck
    from ..model.lora import MERGED_DIR, base_fingerprint, load_base, trainable_names, write_adapter, write_merged
    from ..plan.registry import adapter_reader
    from ..tasks import task_of_model_class

    meta = ck.read_meta(ckpt_dir)
    info = meta.extra["lora"]
    task = task_of_model_class(meta.model_class)
    hf_config = AutoConfig.from_pretrained(str(ckpt_dir))
    if base_fingerprint(info["base"]) != info["base_hash"]:
        raise UserError(f"export: {ckpt_dir} was trained on base {info['base']} ({info['base_hash']}), which now "
                        f"hashes {base_fingerprint(info['base'])}; restore that base to export the adapter")
    model = get_peft_model(load_base(info["base"], task, hf_config), LoraConfig.from_pretrained(str(ckpt_dir)))
    wanted = trainable_names(model)
    state = adapter_reader(meta.format, ckpt_dir)(ckpt_dir, model)
    missing = sorted(set(wanted) - set(state))
    if missing:
        raise UserError(f"export: {ckpt_dir} lacks adapter weights {missing[:3]}; the checkpoint is damaged")
    write_adapter(out, model, {k: state[k].float() for k in wanted}, tokenizer=ckpt_dir)
    if merge:
        write_merged(out / MERGED_DIR, out, load_base(info["base"], task, hf_config), tokenizer=ckpt_dir)
    return out
