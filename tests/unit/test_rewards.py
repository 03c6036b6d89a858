"""GRPO's rewards (zerotrain/train/rewards.py) without ranks: reward functions from a file and from a module, weights,
None -> NaN, a reward model built locally, the same per-reward scores and total as TRL 1.16's own
GRPOTrainer._calculate_rewards (TRL's method run on the same inputs), the metrics and their cross-rank sums, and
every refusal as one line naming the item."""
from __future__ import annotations

import math
import textwrap
import types
from collections import defaultdict

import pytest
import torch

from tests.support.make_pref_data import pairs, tiny_tokenizer
from zerotrain.errors import UserError
from zerotrain.train import rewards as R

REWARDS_PY = '''
import asyncio

CALLS = []


def length_reward(completions, **kwargs):
    CALLS.append(("length_reward", sorted(kwargs)))
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [len(t.split()) / 10 for t in texts]


def answer_reward(prompts, completions, answer, level, trainer_state, **kwargs):
    """1 where the completion holds the row's answer, None for level-2 rows (not this reward's business)."""
    named = ["prompts", "completions", "answer", "level", "trainer_state"]
    CALLS.append(("answer_reward", sorted(named + list(kwargs))))
    kwargs["log_metric"]("answer_hits", 0.5)
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [None if lv == 2 else float(a in t) + trainer_state.global_step / 100
            for t, a, lv in zip(texts, answer, level)]


def ids_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


async def async_reward(completions, **kwargs):
    await asyncio.sleep(0)
    return [0.25] * len(completions)


def none_reward(completions, **kwargs):
    return [None] * len(completions)


def raises_on_third(completions, **kwargs):
    for c in completions:
        if "boom" in (c if isinstance(c, str) else c[0]["content"]):
            raise KeyError("no answer here")
    return [0.0] * len(completions)


def short_reward(completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def text_reward(completions, **kwargs):
    return ["good"] * len(completions)


def scalar_reward(completions, **kwargs):
    return 1.0


NOT_CALLABLE = 3
'''


@pytest.fixture()
def rewards_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent(REWARDS_PY))
    return path


def _batch(n: int = 6, conv: bool = False) -> dict:
    """n prompt-completion pairs (each prompt twice: two generations), the answer and level columns, token ids."""
    rows = pairs(n // 2, seed=5, conversational=conv)
    prompts = [r["prompt"] for r in rows for _ in range(2)]
    texts = [w for r in rows for w in (r["chosen"], r["rejected"])]
    if conv:
        texts = [t[0]["content"] for t in texts]
    answer = [t.split()[1] if i % 3 else "zzz" for i, t in enumerate(texts)]
    completions = [[{"role": "assistant", "content": t}] for t in texts] if conv else texts
    ids = [list(range(len(t.split()))) for t in texts]
    return dict(prompts=prompts, completions=completions, completion_ids=ids,
                columns={"answer": answer, "level": [i % 3 for i in range(n)]})


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


def test_functions_from_a_file_and_a_module_weights_and_none(rewards_file, tmp_path, monkeypatch):
    pkg = tmp_path / "pkg_src" / "myrw"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "more.py").write_text("def ids_len(completion_ids, **kw):\n"
                                 "    return [len(i) * 1.0 for i in completion_ids]\n")
    monkeypatch.syspath_prepend(str(tmp_path / "pkg_src"))
    spec = f"{rewards_file}:length_reward, {rewards_file}:answer_reward,myrw.more:ids_len,{rewards_file}:async_reward"
    rs = R.load_reward_funcs(spec, "1,2,0.5,-1", None, "cpu")
    assert rs.names == ["length_reward", "answer_reward", "ids_len", "async_reward"]
    assert rs.weights.tolist() == [1.0, 2.0, 0.5, -1.0]
    b = _batch()
    state = R.make_trainer_state(global_step=7, max_steps=40)
    per = rs.score(b["prompts"], b["completions"], b["completion_ids"], b["columns"], first_index=12,
                   trainer_state=state)
    assert per.shape == (6, 4) and per.dtype == torch.float32
    texts = b["completions"]
    assert per[:, 0].tolist() == pytest.approx([len(t.split()) / 10 for t in texts])
    for i in range(6):
        if b["columns"]["level"][i] == 2:
            assert math.isnan(per[i, 1])
        else:
            assert per[i, 1].item() == pytest.approx(float(b["columns"]["answer"][i] in texts[i]) + 0.07)
    assert per[:, 2].tolist() == [float(len(i)) for i in b["completion_ids"]]
    assert per[:, 3].tolist() == [0.25] * 6
    assert rs.pending_metrics["answer_hits"] == [0.5]
    total = R.total_reward(per, rs.weights)
    assert torch.allclose(total, torch.nansum(per * rs.weights, dim=1))  # NaN counts 0 (TRL's nansum)
    called = dict(__import__("sys").modules[rs.rewards[0].__module__].CALLS)
    # every keyword TRL 1.16 passes: the columns, trainer_state, log_extra, log_metric (prompts and completion_ids too)
    assert called["length_reward"] == ["answer", "completion_ids", "level", "log_extra", "log_metric", "prompts",
                                       "trainer_state"]


def test_a_row_every_reward_skips_is_nan_and_warned(rewards_file):
    rs = R.load_reward_funcs(f"{rewards_file}:none_reward", None, None)
    b = _batch(4)
    with pytest.warns(UserWarning, match="prompt index 8"):
        per = rs.score(b["prompts"], b["completions"], b["completion_ids"], b["columns"], first_index=8)
    assert torch.isnan(per).all() and torch.isnan(R.total_reward(per, rs.weights)).all()


@pytest.mark.parametrize("fn, expect", [
    ("raises_on_third", ["'raises_on_third' raised KeyError", "at prompt index 7", "fix the function"]),
    ("short_reward", ["'short_reward' returned 5 rewards for 6 completions", "prompt indices 5..10"]),
    ("text_reward", ["'text_reward' returned str 'good' at prompt index 5", "return a float"]),
    ("scalar_reward", ["'scalar_reward' returned a float, not a list"]),
])
def test_a_bad_function_is_named_with_the_prompt_index(rewards_file, fn, expect):
    rs = R.load_reward_funcs(f"{rewards_file}:{fn}", None, None)
    b = _batch()
    b["completions"][2] = b["completions"][2] + " boom"
    with pytest.raises(UserError) as e:
        rs.score(b["prompts"], b["completions"], b["completion_ids"], b["columns"], first_index=5)
    text = _one_line(e)
    assert text.startswith(f"--reward-funcs {rewards_file}:{fn}: reward function")
    for part in expect:
        assert part in text, text


def test_loading_refusals_are_one_line(rewards_file, tmp_path):
    cases = [
        (f"{tmp_path}/missing.py:f", None, ["--reward-funcs", "missing.py:f", "no such file"]),
        ("no_such_module_zt:f", None, ["--reward-funcs no_such_module_zt:f", "not importable", "PYTHONPATH"]),
        (f"{rewards_file}:nope", None, [":nope", "has no 'nope'", "length_reward"]),
        (f"{rewards_file}:NOT_CALLABLE", None, ["'NOT_CALLABLE' is a int, not a function"]),
        (f"{rewards_file}", None, ["expected FILE.py:FUNCTION"]),
        (None, None, ["needs a reward", "--reward-funcs", "--reward-model"]),
        (f"{rewards_file}:length_reward,{rewards_file}:answer_reward", "1", ["--reward-weights 1: 1 weights for 2",
                                                                            "length_reward, answer_reward"]),
        (f"{rewards_file}:length_reward", "x", ["--reward-weights x: not a comma-separated list"]),
        (f"{rewards_file}:length_reward,{rewards_file}:length_reward", None, ["two rewards are named 'length_reward'"]),
    ]
    for spec, weights, expect in cases:
        with pytest.raises(UserError) as e:
            R.load_reward_funcs(spec, weights, None)
        for part in expect:
            assert part in _one_line(e), (part, str(e.value))
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_zt\n")
    with pytest.raises(UserError) as e:
        R.load_reward_funcs(f"{broken}:f", None, None)
    assert "running" in _one_line(e) and "ModuleNotFoundError" in str(e.value)


def _reward_model_dir(path, num_labels: int = 1, seed: int = 0):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from tests.support.families import VOCAB

    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=128, bos_token_id=0,
                      eos_token_id=0, num_labels=num_labels)
    torch.manual_seed(seed)
    LlamaForSequenceClassification(cfg).save_pretrained(str(path))
    tiny_tokenizer(add_bos=True).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return _reward_model_dir(tmp_path_factory.mktemp("rm") / "tiny-rm")


def test_a_reward_model_scores_as_the_model_called_directly(rm_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rs = R.load_reward_funcs(None, None, str(rm_dir))
    assert rs.names == ["tiny-rm"]
    b = _batch()
    per = rs.score(b["prompts"], b["completions"], b["completion_ids"], b["columns"])
    model = AutoModelForSequenceClassification.from_pretrained(str(rm_dir)).eval()
    tok = AutoTokenizer.from_pretrained(str(rm_dir))
    model.config.pad_token_id = tok.eos_token_id
    with torch.no_grad():
        direct = [model(**tok(p + c, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
                  for p, c in zip(b["prompts"], b["completions"])]
    assert per[:, 0].tolist() == pytest.approx(direct, abs=1e-5)
    assert len(set(round(x, 4) for x in direct)) > 1  # the texts score differently: the check can fail


def test_reward_model_refusals(tmp_path):
    two = _reward_model_dir(tmp_path / "two", num_labels=2)
    with pytest.raises(UserError) as e:
        R.load_reward_funcs(None, None, str(two))
    assert "num_labels=2" in _one_line(e) and str(two) in str(e.value)
    with pytest.raises(UserError) as e:
        R.load_reward_funcs(None, None, str(tmp_path / "nothing"))
    assert "--reward-model" in _one_line(e) and "no config.json" in str(e.value)
    bare = _reward_model_dir(tmp_path / "bare")
    for f in bare.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(UserError) as e:
        R.load_reward_funcs(None, None, str(bare))
    assert "its tokenizer does not load" in _one_line(e)


def test_a_reward_model_is_never_built_under_a_live_zero3_config(rm_dir):
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    live = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    try:
        with pytest.raises(RuntimeError, match="before the ZeRO-3 engine"):
            R.load_reward_funcs(None, None, str(rm_dir))
    finally:
        del live
        unset_hf_deepspeed_config()


def _trl_rewards(rm_dir, rewards_file, b, step: int):
    """TRL 1.16's GRPOTrainer._calculate_rewards on b, with its reward model and the file's functions set up as its
    __init__ does (the trainer object holds only what the method reads)."""
    import importlib.util

    from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerState
    from trl.trainer.grpo_trainer import GRPOTrainer

    spec = importlib.util.spec_from_file_location("trl_side_rewards", rewards_file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = AutoModelForSequenceClassification.from_pretrained(str(rm_dir), num_labels=1).eval()
    tok = AutoTokenizer.from_pretrained(str(rm_dir))
    if tok.pad_token_id is None:  # GRPOTrainer.__init__'s reward processing class
        tok.pad_token = tok.eos_token
    model.config.get_text_config().pad_token_id = tok.pad_token_id
    t = object.__new__(GRPOTrainer)
    t.accelerator = types.SimpleNamespace(device=torch.device("cpu"), is_main_process=True)
    t.args = types.SimpleNamespace(report_to=[], device=torch.device("cpu"))
    t.is_deepspeed_enabled = False
    t.state = TrainerState(global_step=step)
    t.reward_funcs = [model, mod.length_reward, mod.answer_reward, mod.ids_reward]
    t.reward_processing_classes = [tok, None, None, None]
    t.reward_func_names = ["tiny-rm", "length_reward", "answer_reward", "ids_reward"]
    t.chat_template_kwargs, t.environments = {}, None
    t._pending_extra_logs, t._pending_metrics = defaultdict(list), defaultdict(list)
    inputs = [{"prompt": p, **{k: v[i] for k, v in b["columns"].items()}} for i, p in enumerate(b["prompts"])]
    return GRPOTrainer._calculate_rewards(t, inputs, b["prompts"], b["completions"], b["completion_ids"])


@pytest.mark.parametrize("conv", [False, True], ids=["plain", "conversational"])
def test_scores_and_total_equal_trls_calculate_rewards(rm_dir, rewards_file, conv):
    from trl.trainer.utils import nanstd

    b = _batch(8, conv=conv)
    spec = ",".join(f"{rewards_file}:{f}" for f in ("length_reward", "answer_reward", "ids_reward"))
    rs = R.load_reward_funcs(spec, "0.5,1,2,-0.25", str(rm_dir))
    assert rs.names == ["tiny-rm", "length_reward", "answer_reward", "ids_reward"]  # TRL's names, its CLI's order
    ours = rs.score(b["prompts"], b["completions"], b["completion_ids"], b["columns"],
                    trainer_state=R.make_trainer_state(3))
    theirs = _trl_rewards(rm_dir, rewards_file, b, step=3)
    assert torch.isnan(theirs[:, 2]).any()
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6, equal_nan=True)
    # TRL's total (_generate_and_score_completions): nansum of the weighted rewards, unscorable rows NaN
    w = rs.weights
    trl_total = (theirs * w.unsqueeze(0)).nansum(dim=1)
    trl_total[torch.isnan(theirs).all(dim=1)] = torch.nan
    torch.testing.assert_close(R.total_reward(ours, w), trl_total, rtol=0, atol=1e-6, equal_nan=True)
    # TRL's metrics, and the same from sums over two "ranks"
    metrics = R.reward_metrics(ours, rs.names)
    for i, name in enumerate(rs.names):
        assert metrics[f"rewards/{name}/mean"] == pytest.approx(torch.nanmean(theirs[:, i]).item(), abs=1e-6)
        assert metrics[f"rewards/{name}/std"] == pytest.approx(nanstd(theirs[:, i]).item(), abs=1e-6)
    summed = R.reward_sums(ours[:3]) + R.reward_sums(ours[3:])
    for k, v in R.metrics_from_sums(summed, rs.names).items():
        assert v == pytest.approx(metrics[k], abs=1e-6), k
    total = R.total_reward(ours, w).unsqueeze(1)
    mean, std = R.mean_std_from_sums(R.reward_sums(total[:5]) + R.reward_sums(total[5:]))
    assert mean.item() == pytest.approx(torch.nanmean(trl_total).item(), abs=1e-6)
    assert std.item() == pytest.approx(nanstd(trl_total).item(), abs=1e-6)


def test_completions_are_decoded_as_trl_presents_them():
    tok = tiny_tokenizer()
    ids = [tok("why is rain soft .", add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
           tok("yes", add_special_tokens=False)["input_ids"]]
    assert R.decode_completions(tok, ids, False) == tok.batch_decode(ids, skip_special_tokens=True)
    conv = R.decode_completions(tok, ids, True)
    assert conv == [[{"role": "assistant", "content": t}] for t in tok.batch_decode(ids, skip_special_tokens=True)]
    assert "<|endoftext|>" not in conv[0][0]["content"]
