"""TRL reference run for zerotrain's reward models: one process, CPU, fp32, every hyperparameter pinned.

    python tests/support/trl_reward_reference.py --model DIR --data FILE.jsonl --out OUT.json
        [--steps N] [--batch B] [--lr LR] [--max-length L] [--lora-r R] [--seed S] [--lora-seed S]
        [--center-rewards-coef X] [--weight-decay WD] [--clip C]

trl.RewardTrainer / RewardConfig on the model zerotrain builds for --task reward: the causal-LM dir loaded as
AutoModelForSequenceClassification (num_labels 1) right after torch.manual_seed(--seed) (zerotrain seeds its fresh
head so: zerotrain/model/source.py ModelBuilder.__call__), config.pad_token_id the tokenizer's pad id (eos where it
has none). With --lora-r, peft's LoraConfig(task_type SEQ_CLS, all-linear, alpha 16, dropout 0: the score head trains
whole through modules_to_save); RewardTrainer calls set_seed(args.seed) right before get_peft_model, so args.seed is
--lora-seed (zerotrain seeds its adapters with --seed + zerotrain/model/lora.py SEED_OFFSET). The data rows are
{prompt, chosen, rejected} (strings or messages) and may carry a "margin" column (TRL subtracts it in the loss).

Writes JSON: {"steps": [{"step": k, "loss": ..., "accuracy", "margin", "mean_reward", "min_reward", "max_reward",
<every other numeric key TRL logged at step k but epoch/timing>}], "trl_version", "transformers_version",
"tokenized": first 3 rows of the trainer's tokenized train set, "config": the config fields set here,
"score_init": the fresh head's weights (a flat list), "loss_check", "lora_init_check" (LoRA only)}.

"loss" is the exact float32 value the trainer's training_step returned for that step (recorded by a subclass); it is
checked against the Trainer's logged logs["loss"] as tests/support/trl_reference.py does.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.support.trl_reference import exact_losses, recording, resolved_lora, step_logs  # noqa: E402

for _k, _v in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "TQDM_DISABLE": "1"}.items():
    os.environ.setdefault(_k, _v)

LORA = {"lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear", "task_type": "SEQ_CLS"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="save_pretrained dir: causal LM + tokenizer")
    p.add_argument("--data", required=True, help=".jsonl of {prompt, chosen, rejected[, margin]} rows")
    p.add_argument("--out", required=True, help="JSON output file")
    p.add_argument("--steps", type=int, default=4, help="max_steps")
    p.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size (the whole batch)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning_rate")
    p.add_argument("--max-length", type=int, default=128, help="max_length (longer pairs are dropped)")
    p.add_argument("--lora-r", type=int, default=0, help="0: full fine-tuning; >0: LoRA rank")
    p.add_argument("--seed", type=int, default=42, help="the head's seed and data_seed")
    p.add_argument("--lora-seed", type=int, default=None, help="args.seed under LoRA (default --seed)")
    p.add_argument("--center-rewards-coef", type=float, default=None, help="center_rewards_coefficient")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=1.0, help="max_grad_norm")
    return p.parse_args(argv)


def reward_config(a: argparse.Namespace, output_dir: str) -> dict:
    """RewardConfig fields, every one pinned (RewardConfig's own defaults differ: gradient_checkpointing True,
    disable_dropout True, bf16 True on CPU)."""
    return {
        "output_dir": output_dir, "use_cpu": True,
        "seed": a.lora_seed if a.lora_r and a.lora_seed is not None else a.seed, "data_seed": a.seed,
        "max_steps": a.steps, "per_device_train_batch_size": a.batch, "gradient_accumulation_steps": 1,
        "learning_rate": a.lr, "weight_decay": a.weight_decay, "max_grad_norm": a.clip,
        "optim": "adamw_torch", "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8,
        "lr_scheduler_type": "constant", "warmup_steps": 0,
        "logging_strategy": "steps", "logging_steps": 1, "logging_first_step": False, "logging_nan_inf_filter": False,
        "report_to": [], "save_strategy": "no", "eval_strategy": "no", "disable_tqdm": True,
        "bf16": False, "fp16": False, "gradient_checkpointing": False,
        "dataloader_num_workers": 0, "dataloader_drop_last": False, "disable_dropout": False,
        "max_length": a.max_length, "pad_to_multiple_of": None,
        "center_rewards_coefficient": a.center_rewards_coef,
    }


def lora_config(a: argparse.Namespace):
    from peft import LoraConfig

    return LoraConfig(r=a.lora_r, **LORA)


def seq_cls_model(a: argparse.Namespace, pad_id: int):
    """The causal-LM dir as a one-label classifier, its head seeded as zerotrain seeds it."""
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(a.seed)
    model = AutoModelForSequenceClassification.from_pretrained(a.model, num_labels=1, dtype=torch.float32)
    model.config.get_text_config().pad_token_id = pad_id
    return model


def lora_init_check(a: argparse.Namespace, trainer, pad_id: int) -> dict:
    """The trainer's fresh adapters == get_peft_model(the same fresh model) after torch.manual_seed(args.seed)."""
    import torch
    from peft import get_peft_model

    fresh = seq_cls_model(a, pad_id)
    torch.manual_seed(trainer.args.seed)
    expected = dict(get_peft_model(fresh, lora_config(a)).named_parameters())
    got = {n: p for n, p in trainer.model.named_parameters() if "lora_" in n}
    worst = max((float((p.detach() - expected[n].detach()).abs().max()) for n, p in got.items()), default=math.inf)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    return {"lora_params": len(got), "trainable": sum(p.numel() for p in got.values() if p.requires_grad),
            "score_trains": any("score" in n for n in trainable), "max_abs_diff_vs_manual_seed": worst,
            "matches": worst == 0.0}


def main(argv=None) -> int:
    a = parse_args(argv)
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback
    from trl import RewardConfig, RewardTrainer

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_warning()
    t0 = time.time()

    Recording = recording(RewardTrainer)

    with tempfile.TemporaryDirectory(prefix="trl_reward_reference_") as tmp:
        tok = AutoTokenizer.from_pretrained(a.model)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        model = seq_cls_model(a, tok.pad_token_id)
        score_init = [float(x) for x in model.score.weight.detach().reshape(-1)]
        data = datasets.load_dataset("json", data_files=a.data, split="train", cache_dir=os.path.join(tmp, "hf"))
        fields = reward_config(a, os.path.join(tmp, "out"))
        logs = step_logs()
        peft_config = lora_config(a) if a.lora_r > 0 else None
        kw = {"model": model, "args": RewardConfig(**fields), "train_dataset": data, "processing_class": tok,
              "callbacks": [logs]}
        if peft_config is not None:
            kw["peft_config"] = peft_config
        trainer = Recording(**kw)
        trainer.step_losses = []
        trainer.remove_callback(PrinterCallback)  # disable_tqdm=True adds it: it only prints the logs, rounded
        lora_check = lora_init_check(a, trainer, tok.pad_token_id) if peft_config is not None else None
        tokenized = [{k: v for k, v in trainer.train_dataset[i].items() if k in ("chosen_ids", "rejected_ids")}
                     for i in range(min(3, len(trainer.train_dataset)))]
        trainer.train()

    worst = exact_losses(logs.steps, trainer.step_losses)
    fields.pop("output_dir")
    fields["trainer"] = "trl.RewardTrainer"
    if peft_config is not None:
        fields["peft_config"] = resolved_lora(peft_config, a.lora_r, LORA)
    result = {"steps": logs.steps, "trl_version": trl.__version__, "transformers_version": transformers.__version__,
              "torch_version": torch.__version__, "tokenized": tokenized, "config": fields, "score_init": score_init,
              "loss_check": {"max_abs_diff_logged_vs_training_step": worst}, "wall_s": round(time.time() - t0, 2),
              **({"lora_init_check": lora_check} if lora_check is not None else {})}
    Path(a.out).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
