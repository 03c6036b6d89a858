"""TRL reference run for zerotrain's preference training: one process, CPU, every hyperparameter pinned.

    python tests/support/trl_reference.py --model DIR --data FILE.jsonl --out OUT.json
        [--method dpo|simpo|orpo|kto] [--steps N] [--batch B] [--lr LR] [--beta BETA]
        [--loss-type sigmoid[,sft...]] [--loss-weights 1,0.5] [--label-smoothing X] [--max-length L]
        [--lora-r R] [--seed S] [--precompute-ref] [--simpo-gamma G] [--weight-decay WD] [--clip C]
        [--desirable-weight W] [--undesirable-weight W] [--eval-data FILE --eval-every N]

dpo   -> trl.DPOTrainer / DPOConfig
simpo -> trl.experimental.cpo.CPOTrainer / CPOConfig(loss_type="simpo", cpo_alpha=0.0)
orpo  -> trl.experimental.orpo.ORPOTrainer / ORPOConfig
kto   -> trl.KTOTrainer / KTOConfig(loss_type="kto"); --data holds unpaired {prompt, completion, label} rows, read in
         file order (KTOConfig's sequential sampling: each batch's KL rows rotate its completions by one)

Writes JSON: {"steps": [{"step": k, "loss": ..., <every numeric key TRL logged at step k but epoch/timing>}],
"trl_version", "transformers_version", "method", "tokenized": first 3 rows of the trainer's tokenized train set,
"config": the TRL config fields set here, "loss_check": ..., "lora_init_check": ... (LoRA only), "evals": every
evaluation's numeric figures with its step (--eval-data only: one eval batch of --batch rows, every --eval-every
steps)}.

"loss" is the exact float32 value the trainer's training_step returned for that step (recorded by a subclass);
it is checked to equal the Trainer's logged logs["loss"] (transformers 5.24 does not round it, with
gradient_accumulation_steps 1 and logging_steps 1 it is that same value).

Exit codes: 0 done, 2 usage error, 3 the experimental trainer cannot run with the installed versions.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback

for _k, _v in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "TRL_EXPERIMENTAL_SILENCE": "1", "TQDM_DISABLE": "1"}.items():
    os.environ.setdefault(_k, _v)

_TIMING = ("runtime", "per_second", "flos")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="save_pretrained dir: causal LM + tokenizer")
    p.add_argument("--data", required=True, help=".jsonl of {prompt, chosen, rejected} rows (kto: {prompt, completion, "
                   "label}; strings or messages)")
    p.add_argument("--out", required=True, help="JSON output file")
    p.add_argument("--method", choices=["dpo", "simpo", "orpo", "kto"], default="dpo")
    p.add_argument("--steps", type=int, default=4, help="max_steps")
    p.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size")
    p.add_argument("--lr", type=float, default=1e-3, help="learning_rate")
    p.add_argument("--beta", type=float, default=0.1, help="beta (DPO/CPO beta; ORPO's lambda is also `beta`)")
    p.add_argument("--loss-type", default="sigmoid", help="dpo only: comma list -> DPOConfig.loss_type")
    p.add_argument("--loss-weights", default=None, help="dpo only: comma list of floats -> DPOConfig.loss_weights")
    p.add_argument("--label-smoothing", type=float, default=0.0, help="DPOConfig / CPOConfig label_smoothing")
    p.add_argument("--max-length", type=int, default=None, help="max_length (omitted: None)")
    p.add_argument("--lora-r", type=int, default=0, help="0: full fine-tuning; >0: LoRA rank (alpha 16, all-linear)")
    p.add_argument("--seed", type=int, default=42, help="seed and data_seed")
    p.add_argument("--precompute-ref", action="store_true", help="dpo, kto: precompute_ref_log_probs=True")
    p.add_argument("--desirable-weight", type=float, default=1.0, help="kto only: KTOConfig.desirable_weight")
    p.add_argument("--undesirable-weight", type=float, default=1.0, help="kto only: KTOConfig.undesirable_weight")
    p.add_argument("--eval-data", default=None, help="eval_dataset (.jsonl, read in order); omitted: no evaluation")
    p.add_argument("--eval-every", type=int, default=0, help="eval_steps (with --eval-data)")
    p.add_argument("--simpo-gamma", type=float, default=0.5, help="simpo only: CPOConfig.simpo_gamma")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=1.0, help="max_grad_norm")
    p.add_argument("--router-logits", action="store_true",
                   help="a mixture of experts: config.output_router_logits=True, which makes TRL add "
                        "router_aux_loss_coef x the router loss (zerotrain trains with it by default)")
    a = p.parse_args(argv)
    a.loss_types = [s.strip() for s in a.loss_type.split(",") if s.strip()]
    a.loss_weight_list = None if a.loss_weights is None else [float(s) for s in a.loss_weights.split(",")]
    if a.method != "kto" and (a.desirable_weight, a.undesirable_weight) != (1.0, 1.0):
        p.error(f"--desirable-weight / --undesirable-weight are kto only, not --method {a.method}")
    if a.method != "dpo":
        bad = [flag for flag, on in [("--loss-type", a.loss_types != ["sigmoid"]),
                                     ("--loss-weights", a.loss_weight_list is not None),
                                     ("--precompute-ref", a.precompute_ref and a.method != "kto")] if on]
        if a.method == "orpo" and a.label_smoothing != 0.0:
            bad.append("--label-smoothing")
        if bad:
            p.error(f"{', '.join(bad)} not supported with --method {a.method}")
    elif a.loss_weight_list is not None and len(a.loss_weight_list) != len(a.loss_types):
        p.error("--loss-weights needs one weight per --loss-type entry")
    return a


def common_args(a: argparse.Namespace, output_dir: str) -> dict:
    """TrainingArguments fields shared by the four configs."""
    return {
        "output_dir": output_dir, "use_cpu": True, "seed": a.seed, "data_seed": a.seed,
        "max_steps": a.steps, "per_device_train_batch_size": a.batch, "gradient_accumulation_steps": 1,
        "learning_rate": a.lr, "weight_decay": a.weight_decay, "max_grad_norm": a.clip,
        "optim": "adamw_torch", "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8,
        "lr_scheduler_type": "constant", "warmup_steps": 0,
        "logging_strategy": "steps", "logging_steps": 1, "logging_first_step": False,
        "logging_nan_inf_filter": False,
        "report_to": [], "save_strategy": "no", "disable_tqdm": True, "per_device_eval_batch_size": a.batch,
        **({"eval_strategy": "steps", "eval_steps": a.eval_every} if a.eval_data else {"eval_strategy": "no"}),
        "bf16": False, "fp16": False, "gradient_checkpointing": False,
        "dataloader_num_workers": 0, "dataloader_drop_last": False,
        "disable_dropout": False,  # dropout stays what the model config says (TRL's default True would zero it)
        "max_length": a.max_length,  # None: DPO no truncation; CPO/ORPO fall back to 512 (with a warning)
    }


LORA = {"lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear", "task_type": "CAUSAL_LM"}


def lora_config(a: argparse.Namespace):
    from peft import LoraConfig

    return LoraConfig(r=a.lora_r, **LORA)


def trainer_classes(a: argparse.Namespace) -> tuple[type, type, dict]:
    """(config class, trainer class, the method's own config fields)."""
    if a.method == "dpo":
        from trl import DPOConfig, DPOTrainer

        return DPOConfig, DPOTrainer, {
            "beta": a.beta, "loss_type": a.loss_types, "loss_weights": a.loss_weight_list,
            "label_smoothing": a.label_smoothing, "precompute_ref_log_probs": a.precompute_ref,
            "truncation_mode": "keep_start", "pad_to_multiple_of": None}
    if a.method == "kto":
        from trl import KTOConfig, KTOTrainer

        return KTOConfig, KTOTrainer, {
            "beta": a.beta, "loss_type": "kto", "desirable_weight": a.desirable_weight,
            "undesirable_weight": a.undesirable_weight, "precompute_ref_log_probs": a.precompute_ref,
            "train_sampling_strategy": "sequential", "pad_to_multiple_of": None}
    try:
        if a.method == "simpo":
            from trl.experimental.cpo import CPOConfig, CPOTrainer

            return CPOConfig, CPOTrainer, {
                "beta": a.beta, "loss_type": "simpo", "cpo_alpha": 0.0, "simpo_gamma": a.simpo_gamma,
                "label_smoothing": a.label_smoothing, "remove_unused_columns": False}
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        return ORPOConfig, ORPOTrainer, {"beta": a.beta, "remove_unused_columns": False}
    except Exception as e:  # noqa: BLE001 - any import failure of the experimental trainer
        unusable(a, e)


def build(a: argparse.Namespace, model, tok, data, output_dir: str, callbacks, eval_data=None):
    """The trainer (a subclass recording each training_step's returned loss), the config fields set, the LoRA
    config (or None)."""
    import torch
    from transformers.trainer_callback import PrinterCallback

    cfg_cls, trainer_cls, extra = trainer_classes(a)
    fields = {**common_args(a, output_dir), **extra}
    args = cfg_cls(**fields)

    Recording = recording(trainer_cls)
    peft_config = lora_config(a) if a.lora_r > 0 else None
    kw = {"model": model, "args": args, "train_dataset": data, "processing_class": tok, "callbacks": callbacks}
    if eval_data is not None:
        kw["eval_dataset"] = eval_data
    if peft_config is not None:
        kw["peft_config"] = peft_config
    torch.manual_seed(a.seed)  # the trainers also call set_seed(args.seed) right before get_peft_model
    trainer = Recording(**kw)
    trainer.step_losses = []
    trainer.remove_callback(PrinterCallback)  # disable_tqdm=True adds it: it only prints the logs, rounded
    fields.pop("output_dir")
    return trainer, fields, peft_config


def unusable(a: argparse.Namespace, e: BaseException):
    import transformers
    import trl

    traceback.print_exc()
    print(f"trl_reference: --method {a.method} cannot run: trl.experimental "
          f"{'cpo.CPOTrainer' if a.method == 'simpo' else 'orpo.ORPOTrainer'} fails with trl {trl.__version__} / "
          f"transformers {transformers.__version__}: {type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(3)


def lora_init_check(a: argparse.Namespace, trainer) -> dict:
    """The trainer's fresh adapters == get_peft_model(fresh model, same config) after torch.manual_seed(seed)."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    torch.manual_seed(a.seed)
    expected = dict(get_peft_model(fresh, lora_config(a)).named_parameters())
    got = {n: p for n, p in trainer.model.named_parameters() if "lora_" in n}
    worst = max((float((p.detach() - expected[n].detach()).abs().max()) for n, p in got.items()), default=math.inf)
    return {"lora_params": len(got), "trainable": sum(p.numel() for p in got.values() if p.requires_grad),
            "max_abs_diff_vs_manual_seed": worst, "matches": worst == 0.0}


def tokenized_rows(dataset, n: int = 3) -> list[dict]:
    """First n rows of the trainer's tokenized train set: token-id / mask / label columns and ref log-probs."""
    out = []
    for i in range(min(n, len(dataset))):
        row = dataset[i]
        keep = {}
        for k, v in row.items():
            if (isinstance(v, list) and all(isinstance(x, int) for x in v)) or (
                    k.startswith("ref_") and isinstance(v, (int, float))):
                keep[k] = v
        out.append(keep)
    return out


def recording(trainer_cls: type) -> type:
    """trainer_cls recording the exact float loss each training_step returns (in .step_losses, set by the caller)."""

    class Recording(trainer_cls):
        step_losses: list[float]

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.step_losses.append(float(loss.detach().float().item()))
            return loss

    return Recording


def step_logs():
    """A TrainerCallback collecting each logged training step's numeric figures (not epoch or timing) in .steps."""
    import torch
    from transformers import TrainerCallback

    class Logs(TrainerCallback):
        def __init__(self):
            self.steps, self.evals = [], []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and ("loss" in logs or "eval_loss" in logs):
                rec = {"step": state.global_step}
                for k, v in logs.items():
                    if k == "epoch" or any(t in k for t in _TIMING):
                        continue
                    if isinstance(v, torch.Tensor) and v.numel() == 1:
                        v = v.item()
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        rec[k] = v
                (self.steps if "loss" in logs else self.evals).append(rec)

    return Logs()


def exact_losses(steps: list[dict], losses: list[float]) -> float:
    """Each logged step's "loss" replaced by the exact value training_step returned (the logged one kept as
    "loss_logged"); returns the largest difference between the two."""
    if len(losses) != len(steps):
        raise RuntimeError(f"{len(losses)} training steps but {len(steps)} logged steps")
    worst = 0.0
    for rec, exact in zip(steps, losses):
        worst = max(worst, abs(rec["loss"] - exact))
        rec["loss_logged"] = rec["loss"]
        rec["loss"] = exact
    return worst


def resolved_lora(peft_config, r: int, fields: dict) -> dict:
    """The LoRA config as the JSON's "config" records it (fields: LoraConfig's pinned arguments)."""
    resolved = peft_config.target_modules
    return {"r": r, **fields, "resolved_target_modules": sorted(resolved) if isinstance(resolved, (set, list))
            else resolved}


def main(argv=None) -> int:
    a = parse_args(argv)
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_warning()
    t0 = time.time()

    with tempfile.TemporaryDirectory(prefix="trl_reference_") as tmp:
        tok = AutoTokenizer.from_pretrained(a.model)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
        if a.router_logits:
            model.config.output_router_logits = True
        # the dataset's map caches (and the precomputed reference log-probs) live in the temp dir, never reused
        data = datasets.load_dataset("json", data_files=a.data, split="train", cache_dir=os.path.join(tmp, "hf"))
        logs = step_logs()
        try:
            eval_data = None if a.eval_data is None else datasets.load_dataset(
                "json", data_files=a.eval_data, split="train", cache_dir=os.path.join(tmp, "hf"))
            trainer, fields, peft_config = build(a, model, tok, data, os.path.join(tmp, "out"), [logs], eval_data)
        except Exception as e:
            if a.method in ("dpo", "kto"):  # not experimental: a failure is a failure
                raise
            unusable(a, e)
        lora_check = lora_init_check(a, trainer) if peft_config is not None else None
        tokenized = tokenized_rows(trainer.train_dataset)
        try:
            trainer.train()
        except Exception as e:
            if a.method in ("dpo", "kto"):  # not experimental: a failure is a failure
                raise
            unusable(a, e)

    worst = exact_losses(logs.steps, trainer.step_losses)
    cfg = dict(fields)
    cfg["trainer"] = type(trainer).__mro__[1].__module__ + "." + type(trainer).__mro__[1].__name__
    if peft_config is not None:
        cfg["peft_config"] = resolved_lora(peft_config, a.lora_r, LORA)
    result = {
        "steps": logs.steps,
        "trl_version": trl.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "method": a.method,
        "tokenized": tokenized,
        "config": cfg,
        "loss_check": {"max_abs_diff_logged_vs_training_step": worst},
        "wall_s": round(time.time() - t0, 2),
    }
    if lora_check is not None:
        result["lora_init_check"] = lora_check
    if a.eval_data is not None:
        result["evals"] = logs.evals
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
