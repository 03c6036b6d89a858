"""Mixtures (zerotrain/data/mixture.py) and prepared data directories (zerotrain/data/prepared.py,
`zerotrain data prepare`): weights and their refusals, the order as a pure function of (sizes, weights, seed,
epoch), per-source shares, the manifest's fingerprint and its one-line refusals, no tokenizing from a prepared
directory. No ranks: the 2-rank runs are tests/multirank/test_data_mixture.py's."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from zerotrain.config.load import build_config
from zerotrain.data import mixture as mix
from zerotrain.data.datasets import prepare_data, train_loader

WORDS = ["Anna walked to the garden", "Ben found a red apple", "the dog slept by the door", "rain fell all day"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROTRAIN_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tokenizer():
    from zerotrain.assets.demo import build_tokenizer

    return build_tokenizer()


def _texts(path, n: int, tag: str):
    """n texts tagged by their source (the tag is one word, so the sources' tokens differ)."""
    import datasets

    rows = [{"text": f"{tag} {i}: {WORDS[i % 4]}. " * 3} for i in range(n)]
    if path.suffix == ".parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_weights_parse_and_refusals():
    assert mix.parse_weights("a.jsonl,b.parquet", "7,3") == pytest.approx([0.7, 0.3])
    assert mix.parse_weights("a.jsonl,b.jsonl", None) is None  # a comma list without weights: concatenated
    with pytest.raises(ValueError, match="a mixture needs a comma list of sources in --data"):
        mix.parse_weights("a.jsonl", "1")
    with pytest.raises(ValueError, match="3 weights for 2 --data sources"):
        mix.parse_weights("a.jsonl,b.jsonl", "0.5,0.3,0.2")
    with pytest.raises(ValueError, match="every weight must be a positive number"):
        mix.parse_weights("a.jsonl,b.jsonl", "1,0")
    with pytest.raises(ValueError, match="expected a comma list of numbers"):
        mix.parse_weights("a.jsonl,b.jsonl", "1,x")


def test_schedule_holds_every_window_to_its_share():
    """Every global batch (window) of 8 takes 0.7 / 0.3 to within one row, cumulatively at every step."""
    src = mix.source_schedule([0.7, 0.3], 800, 8, seed=1, epoch=0)
    for end in range(8, 801, 8):
        assert abs(int((src[:end] == 0).sum()) - 0.7 * end) < 1.0, end
    assert not np.array_equal(src, mix.source_schedule([0.7, 0.3], 800, 8, seed=2, epoch=0))  # shuffled by seed


def test_order_is_pure_oversamples_the_small_source_and_sees_every_row():
    sizes, weights = [10, 50], [0.7, 0.3]
    assert mix.epoch_length(sizes, weights) == 167  # until the large source is seen whole: 50 / 0.3
    src, rows = mix.mixture_order(sizes, weights, seed=3, epoch=0, window=8)
    again = mix.mixture_order(sizes, weights, seed=3, epoch=0, window=8)
    assert np.array_equal(src, again[0]) and np.array_equal(rows, again[1])
    assert not np.array_equal(rows, mix.mixture_order(sizes, weights, seed=3, epoch=1, window=8)[1])
    for s, n in enumerate(sizes):
        assert set(rows[src == s].tolist()) == set(range(n))  # every row of every source in the epoch
    small = np.bincount(rows[src == 0], minlength=10)
    assert small.min() >= 11 and small.max() - small.min() <= 1  # restarted ~11.7 times, evenly
    assert abs((src == 0).mean() - 0.7) < 0.01


def test_mixture_of_two_file_types_shares_per_step(tmp_path, tokenizer):
    """--data a.jsonl,b.parquet --data-weights 0.7,0.3: each source packed on its own; the loaders of 2 ranks give
    each optimizer step the weights' shares of tokens and rows, within 2%, and the loader replays on resume."""
    a, b = _texts(tmp_path / "a.jsonl", 60, "alpha"), _texts(tmp_path / "b.parquet", 60, "beta")
    cfg = build_config(overrides={"data.path": f"{a},{b}", "data.data_weights": "0.7,0.3", "data.seq_len": 16})
    d = prepare_data(cfg, tokenizer)
    assert d.mixture is not None and d.mixture.names == ["a", "b"] and d.rows_tokenized == 120
    assert "mixture a 0.7 of" in d.description and "120 rows tokenized before step 1" in d.description
    assert d.epoch_rows == mix.epoch_length(d.mixture.sizes, d.mixture.weights) > len(d.train)
    world, micro, accum = 2, 2, 2
    loaders = [list(train_loader(d, r, world, micro, seed=5, epoch=0, global_batch=world * micro * accum))
               for r in range(world)]
    total = np.zeros((2, 2))
    for step in range(len(loaders[0]) // accum):
        counts = sum(b[mix.SOURCE_COUNTS] for r in range(world) for b in loaders[r][step * accum:(step + 1) * accum])
        total += counts.numpy()
        share = total / total.sum(1, keepdims=True)
        assert share[:, 0] == pytest.approx([0.7, 0.7], abs=0.02 + 1 / total[1].sum()), step
    assert share[:, 0] == pytest.approx([0.7, 0.7], abs=0.02)
    # each source packed on its own, one after the other; a position's row is its source's
    alone = prepare_data(build_config(overrides={"data.path": str(a), "data.seq_len": 16}), tokenizer)
    assert d.train["input_ids"][:d.mixture.sizes[0]] == alone.train["input_ids"]
    rows = d.mixture.rows(d.train, seed=5, epoch=0, window=8)
    for i in range(0, len(rows), 7):
        src, row = int(rows.src[i]), int(rows.index[i])
        assert rows[i]["source"] == src and d.mixture.offsets[src] <= row < d.mixture.offsets[src] + d.mixture.sizes[src]
    resumed = list(train_loader(d, 1, world, micro, seed=5, epoch=0, skip_micro_batches=3,
                                global_batch=world * micro * accum))
    assert all((x["input_ids"] == y["input_ids"]).all() for x, y in zip(loaders[1][3:], resumed))


def test_mixture_refusals(tmp_path, tokenizer):
    a, b = _texts(tmp_path / "a.jsonl", 20, "alpha"), _texts(tmp_path / "b.jsonl", 20, "beta")
    chat = tmp_path / "c.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"hi {i}"},
                                                      {"role": "assistant", "content": "hello"}]}) + "\n"
                            for i in range(20)))
    cfg = build_config(overrides={"data.path": f"{a},{chat}", "data.data_weights": "1,1", "data.seq_len": 64,
                                  "data.chat_template": "chatml"})
    with pytest.raises(ValueError, match="the sources of a mixture must be one kind of data"):
        prepare_data(cfg, tokenizer)
    pairs = tmp_path / "p.jsonl"
    pairs.write_text(json.dumps({"prompt": "q", "chosen": "a", "rejected": "b"}) + "\n")
    cfg = build_config(overrides={"model.task": "dpo", "data.path": f"{pairs},{pairs}", "data.data_weights": "1,1"})
    with pytest.raises(ValueError, match="--data-weights: mixtures are built for causal-lm data"):
        prepare_data(cfg, tokenizer)
    cfg = build_config(overrides={"data.path": f"{a},{b}", "data.seq_len": 16})  # concatenated, as before
    d = prepare_data(cfg, tokenizer)
    assert d.mixture is None and d.epoch_rows == len(d.train)


def _prepare(argv: list[str]) -> None:
    from zerotrain.cli import main

    assert main(["data", "prepare", *argv]) == 0


def _tokenizer_of(cfg):
    from zerotrain.model.source import resolve_model

    return resolve_model(cfg).tokenizer


@pytest.mark.parametrize("kind", ["text-mixture", "chat-packed"])
def test_prepared_directory_reads_without_tokenizing_and_refuses_mismatches(tmp_path, kind, capsys):
    """`zerotrain data prepare` (2 tokenizing processes) writes shards + manifest; prepare_data on the directory
    gives the raw files' rows exactly, tokenizes none, and refuses another --seq-len, packing or tokenizer in one
    line naming the setting and the prepared value."""
    out = tmp_path / "prepared"
    if kind == "text-mixture":
        a, b = _texts(tmp_path / "a.jsonl", 40, "alpha"), _texts(tmp_path / "b.parquet", 30, "beta")
        flags = {"data.path": f"{a},{b}", "data.data_weights": "0.6,0.4", "data.seq_len": 16}
        argv = ["--data", f"{a},{b}", "--data-weights", "0.6,0.4", "--seq-len", "16"]
    else:
        chat = tmp_path / "c.jsonl"
        chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"hi {i}, {WORDS[i % 4]}"},
                                                          {"role": "assistant", "content": WORDS[(i + 1) % 4]}]})
                                + "\n" for i in range(50)))
        flags = {"data.path": str(chat), "data.seq_len": 64, "data.chat_template": "chatml", "data.packing": "separate"}
        argv = ["--data", str(chat), "--seq-len", "64", "--chat-template", "chatml", "--packing"]
    _prepare([*argv, "--output", str(out), "--num-proc", "2"])
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "2 tokenizing processes" in printed
    manifest = json.loads((out / "zerotrain-data.json").read_text())
    cfg = build_config(overrides=flags)
    tok = _tokenizer_of(cfg)
    raw = prepare_data(cfg, tok)
    assert manifest["train_rows"] == len(raw.train) and manifest["settings"]["seq_len"] == flags["data.seq_len"]
    cfg_dir = build_config(overrides={**{k: v for k, v in flags.items() if k not in ("data.path", "data.data_weights")},
                                      "data.path": str(out)})
    got = prepare_data(cfg_dir, tok)
    assert got.rows_tokenized == 0 and "0 rows tokenized before step 1" in got.description
    assert got.train["input_ids"] == raw.train["input_ids"] and got.train.column_names == raw.train.column_names
    if kind == "text-mixture":
        assert got.mixture.sizes == raw.mixture.sizes and got.mixture.weights == pytest.approx([0.6, 0.4])
        assert [s["name"] for s in manifest["sources"]] == ["a", "b"]
        reweighted = prepare_data(cfg_dir.model_copy(update={"data": cfg_dir.data.model_copy(
            update={"data_weights": "1,1"})}), tok)  # the same rows, weighted anew
        assert reweighted.mixture.weights == [0.5, 0.5] and reweighted.rows_tokenized == 0
    else:  # one dataset prepared: weights have no sources to weigh (one line, not an IndexError in the sampler)
        with pytest.raises(ValueError, match=r"^--data-weights 1,1: --data .* was prepared as one dataset"):
            prepare_data(cfg_dir.model_copy(update={"data": cfg_dir.data.model_copy(
                update={"data_weights": "1,1"})}), tok)
    seq = flags["data.seq_len"]
    with pytest.raises(ValueError, match=f"^--seq-len 32: --data {re.escape(str(out))} was prepared with --seq-len {seq}; "):
        prepare_data(build_config(overrides={**flags, "data.path": str(out), "data.seq_len": 32,
                                             "data.data_weights": None}), tok)
    other = {"data.packing": "off"} if kind == "chat-packed" else {"data.pack": False}
    flag = "--packing" if kind == "chat-packed" else "--pack"
    with pytest.raises(ValueError, match=f"^{flag} .*was prepared with {flag} "):
        prepare_data(build_config(overrides={**flags, "data.path": str(out), "data.data_weights": None, **other}), tok)
    from zerotrain.assets.demo import build_tokenizer

    with pytest.raises(ValueError, match=r"^--model: its tokenizer \(fingerprint \w+\) is not the one --data"):
        prepare_data(cfg_dir, build_tokenizer(vocab_size=400))  # the corpus trains 742 tokens at most


def test_prepare_refuses_other_tasks_and_a_busy_output(tmp_path, capsys):
    from zerotrain.cli import main

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    assert main(["data", "prepare", "--output", str(busy)]) == 2
    assert "--output" in capsys.readouterr().err
    pairs = tmp_path / "p.jsonl"
    pairs.write_text(json.dumps({"prompt": "q", "chosen": "a", "rejected": "b"}) + "\n")
    assert main(["data", "prepare", "--task", "dpo", "--data", str(pairs), "--output", str(tmp_path / "o")]) == 2
    assert "--task dpo is not supported" in capsys.readouterr().err


def test_a_resume_with_another_mixture_is_refused():
    m = mix.Mixture(["a", "b"], [21, 9], [0.7, 0.3])
    mix.resume_check(json.loads(json.dumps(m.record())), m)  # the checkpoint's record, through its JSON
    mix.resume_check(None, None)  # no mixture then, none now
    with pytest.raises(ValueError, match=r"^--data-weights: the checkpoint's run trained on mixture a 0.7 of 21 rows, "
                                         r"b 0.3 of 9 rows, this run on mixture a 0.5"):
        mix.resume_check(m.record(), mix.Mixture(["a", "b"], [21, 9], [0.5, 0.5]))
    with pytest.raises(ValueError, match="this run on no mixture"):
        mix.resume_check(m.record(), None)
