"""`zerotrain data prepare`: tokenize (and pack) a training set once, with every core, into a directory that
`zerotrain train --data DIR` reads on every node without tokenizing again (zerotrain/data/prepared.py).

    zerotrain data prepare --data a.jsonl,b.parquet --data-weights 0.7,0.3 --model M --seq-len 512 --output DIR
    zerotrain train --data DIR --model M --seq-len 512 ...     # on every node: 0 rows tokenized before step 1

It prepares causal-lm data (plain text, packed or not; chat and prompt-completion, packed or not); other tasks
tokenize at train time and are refused here by name.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from ..config.flags import add_run_flags, config_from_args
from ..config.schema import field_paths
from ..errors import UserError
from ..tasks import task_spec

KEPT = ("data.", "model.name", "model.from_config", "model.task", "run.seed")
"""The run-config keys that change what is tokenized (the others are train's alone, so not flags here)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", parser_class=type(p))
    sub.required = True
    what = ("tokenize (and pack) --data once with every core into --output DIR: Arrow shards and a manifest that "
            "`zerotrain train --data DIR` reads without tokenizing again")
    prep = sub.add_parser("prepare", help=what, description=what)
    prep.add_argument("--output", required=True, metavar="DIR", help="the directory to write (new, empty, or "
                      "prepared before: replaced)")
    prep.add_argument("--num-proc", type=int, default=None, metavar="N",
                      help="tokenizing processes (default: every core, os.cpu_count())")
    add_run_flags(prep, skip=[k for k in field_paths() if not k.startswith(KEPT)])


def run(args: argparse.Namespace) -> int:
    from ..data import datasets as data_sets
    from ..data import prepared
    from ..data.mixture import source_names
    from ..model.source import resolve_model

    cfg = config_from_args(args)
    task = cfg.model.task
    if not task_spec(task).streams:  # what prepare writes is what a stream reads: causal-lm text and samples
        raise UserError(f"zerotrain data prepare: --task {task} is not supported (it prepares causal-lm data: text, "
                        "chat, prompt-completion); train it on its raw --data")
    if prepared.is_prepared(cfg.data.path):
        raise UserError(f"--data {cfg.data.path}: already prepared; train on it with `zerotrain train --data "
                        f"{cfg.data.path}`")
    out = Path(args.output).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir()) and not prepared.is_prepared(str(out))):
        raise UserError(f"--output {out}: holds files that are not prepared data; pass a new or empty directory")
    procs = args.num_proc or os.cpu_count() or 1
    if procs < 1:
        raise UserError(f"--num-proc {procs}: must be >= 1")
    source = resolve_model(cfg)
    if source.processor is not None:  # an image-text model (zerotrain/data/vision.py)
        raise UserError(f"--model {cfg.model.name}: an image-text model; its chats with images are tokenized when "
                        "`zerotrain train` starts and their images decoded as it trains; train on the JSONL directly")
    start = time.perf_counter()
    data_sets.MAP_PROCS["num_proc"] = procs  # and datasets' tqdm bars on (zerotrain/data/datasets.py load_raw)
    try:
        data = data_sets.prepare_data(cfg, source.tokenizer)
    finally:  # in-process callers (tests) tokenize as training ranks do afterwards
        data_sets.MAP_PROCS["num_proc"] = None
    settings = {**data_sets.data_settings(cfg, source.tokenizer, data.text_packing, data.chat_template),
                "model": cfg.model.name or source.description}
    if data.mixture is not None:
        paths = [s.strip() for s in (cfg.data.path or "").split(",") if s.strip()]
        sources = [{"path": p, "name": n, "rows": r} for p, n, r in zip(paths, data.mixture.names, data.mixture.sizes)]
    else:
        spec = cfg.data.path or "the embedded corpus"
        sources = [{"path": spec, "name": source_names([spec])[0], "rows": len(data.train)}]
    manifest = prepared.write(out, data.train, data.eval, settings, sources,
                              data.mixture.weights if data.mixture else None, data.description, procs)
    print(f"zerotrain data prepare: {data.description}\n"
          f"  wrote {out}: {manifest['train_rows']} train rows" +
          (f", {manifest['eval_rows']} eval rows" if manifest["eval_rows"] else "") +
          f" in {time.perf_counter() - start:.1f} s ({procs} tokenizing processes)\n"
          f"  train on it: zerotrain train --data {out} with the same --model and data settings "
          f"(--seq-len {cfg.data.seq_len})")
    return 0
