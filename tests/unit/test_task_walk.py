"""The task, resolved once, is handed on from the CLI to the first step visiting no module more than twice, for
every training kind (issue 65): tests/support/task_walk.py follows it through a real `zerotrain train` of each."""
from __future__ import annotations

import subprocess
import sys

from tests.support.launch import REPO, rank_env
from tests.support.task_walk import visits


def test_a_module_called_again_after_another_is_a_second_visit():
    calls = [("config/rules.py", "check_qat"), ("config/rules.py", "check_head"), ("model/facts.py", "meta_model"),
             ("config/rules.py", "unused_settings"), ("model/facts.py", "meta_model")]
    assert visits(calls) == [("config/rules.py", ["check_qat", "check_head"]), ("model/facts.py", ["meta_model"]),
                             ("config/rules.py", ["unused_settings"]), ("model/facts.py", ["meta_model"])]


def test_every_kind_hands_the_task_to_each_module_at_most_twice():
    run = subprocess.run([sys.executable, "-m", "tests.support.task_walk", "--every-kind", "--max-visits", "2"],
                         cwd=REPO, env=rank_env(), capture_output=True, text=True, timeout=600)
    walked = [line[2:] for line in run.stdout.splitlines() if line.startswith("# ")]
    assert walked == ["causal-lm", "seq-cls", "dpo", "kto", "reward", "grpo", "image-text"], run.stdout + run.stderr
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
