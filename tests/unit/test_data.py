"""zerotrain.data.datasets and its text reader (zerotrain/data/text.py): formats, label inference, packing,
deterministic and resumable order, padded eval."""
from __future__ import annotations

import json

import pytest

from zerotrain.config.load import build_config
from zerotrain.data.datasets import EvalSampler, ResumableSampler, prepare_data, steps_per_epoch, train_loader
from zerotrain.data.reader import load_raw
from zerotrain.data.text import collate, label_names


@pytest.fixture(scope="module")
def tokenizer():
    from zerotrain.assets.demo import build_tokenizer

    return build_tokenizer()


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROTRAIN_CACHE", str(tmp_path / "cache"))


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("ext", [".jsonl", ".json", ".csv", ".txt", ".parquet"])
def test_local_formats(tmp_path, ext):
    import datasets

    rows = [{"text": f"line {i}"} for i in range(5)]
    p = tmp_path / f"d{ext}"
    if ext == ".txt":
        p.write_text("".join(r["text"] + "\n" for r in rows))
    else:
        getattr(datasets.Dataset.from_list(rows), {".jsonl": "to_json", ".json": "to_json", ".csv": "to_csv",
                                                   ".parquet": "to_parquet"}[ext])(str(p))
    ds = load_raw(str(p), "--data")
    assert ds["text"] == [r["text"] for r in rows]


def test_labels_strings_ints_and_num_labels(tmp_path):
    import datasets

    s = datasets.Dataset.from_list([{"label": x} for x in ["neg", "pos", "neg", "mid"]])
    assert label_names(s, "label", None) == (3, {0: "mid", 1: "neg", 2: "pos"})
    i = datasets.Dataset.from_list([{"label": x} for x in [0, 2, 1]])
    assert label_names(i, "label", None) == (3, None)
    assert label_names(i, "label", 5) == (5, None)
    with pytest.raises(ValueError, match="--num-labels 2 is smaller than the 3 labels"):
        label_names(i, "label", 2)


def test_packing_blocks_and_collate(tmp_path, tokenizer):
    p = _write(tmp_path / "t.jsonl", [{"text": "Anna walked to the garden. " * 20}] * 10)
    cfg = build_config(overrides={"data.path": str(p), "data.seq_len": 32, "data.eval_split": 0.2})
    d = prepare_data(cfg, tokenizer)
    assert all(len(x) == 32 for x in d.train["input_ids"])
    assert d.eval is not None and len(d.eval) > 0
    b = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}], pad_id=0)
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["labels"].tolist() == [[5, 6, 7], [8, -100, -100]]


def test_packing_spans_every_text_of_the_dataset(tmp_path, tokenizer):
    """2,500 short texts (more than one tokenizing batch of 1,000) packed into 1,024-token blocks: the blocks are
    the whole token stream in order, texts joined by EOS, only the final partial block dropped (packing each
    batch of texts on its own lost every batch's remainder: with ~10-token texts, every block of this size)."""
    texts = [f"note {i}: Anna walked to the garden." for i in range(2500)]
    p = _write(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    cfg = build_config(overrides={"data.path": str(p), "data.seq_len": 1024})
    d = prepare_data(cfg, tokenizer)
    stream = [i for t in texts for i in tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]]
    blocks = d.train["input_ids"]
    assert len(blocks) == len(stream) // 1024 >= 20
    assert [i for b in blocks for i in b] == stream[:len(blocks) * 1024]


def test_seq_cls_prepare_and_eval_label_check(tmp_path, tokenizer):
    train = _write(tmp_path / "tr.jsonl", [{"text": f"good {i}", "label": "pos"} for i in range(4)]
                   + [{"text": f"bad {i}", "label": "neg"} for i in range(4)])
    bad_eval = _write(tmp_path / "ev.jsonl", [{"text": "meh", "label": "other"}])
    cfg = build_config(overrides={"model.task": "seq-cls", "data.path": str(train)})
    d = prepare_data(cfg, tokenizer)
    assert d.num_labels == 2 and d.id2label == {0: "neg", 1: "pos"}
    assert sorted(set(d.train["labels"])) == [0, 1]
    cfg = build_config(overrides={"model.task": "seq-cls", "data.path": str(train), "data.eval_path": str(bad_eval)})
    with pytest.raises(ValueError, match="label 'other' does not occur in the training data"):
        prepare_data(cfg, tokenizer)


def test_too_little_text_for_one_block(tmp_path, tokenizer):
    p = _write(tmp_path / "t.jsonl", [{"text": "hi"}])
    cfg = build_config(overrides={"data.path": str(p), "data.seq_len": 64})
    with pytest.raises(ValueError, match="fewer than --seq-len 64 tokens"):
        prepare_data(cfg, tokenizer)


def test_order_is_deterministic_disjoint_and_resumable():
    data = list(range(40))
    a0 = list(ResumableSampler(data, 2, 0, seed=7))
    a1 = list(ResumableSampler(data, 2, 1, seed=7))
    assert not set(a0) & set(a1) and len(a0) == len(a1) == 20
    assert a0 == list(ResumableSampler(data, 2, 0, seed=7))  # same seed, same order
    s = ResumableSampler(data, 2, 0, seed=7)
    s.set_epoch(1)
    epoch1 = list(s)
    assert epoch1 != a0
    s.skip = 6
    assert list(s) == epoch1[6:] and len(s) == 14
    assert steps_per_epoch(40, 2, 4, 2) == 2


def test_resumed_loader_replays_the_same_batches(tmp_path, tokenizer):
    p = _write(tmp_path / "t.jsonl", [{"text": f"Ben found a red apple number {i}. " * 4} for i in range(60)])
    cfg = build_config(overrides={"data.path": str(p), "data.seq_len": 16})
    d = prepare_data(cfg, tokenizer)
    full = [b["input_ids"] for b in train_loader(d, 1, 2, 2, seed=3, epoch=2)]
    tail = [b["input_ids"] for b in train_loader(d, 1, 2, 2, seed=3, epoch=2, skip_micro_batches=3)]
    assert len(tail) == len(full) - 3 and all((x == y).all() for x, y in zip(full[3:], tail))


def test_eval_sampler_equal_counts_and_valid_mask():
    n, world, mb = 11, 2, 4
    shards = [EvalSampler(n, world, r, mb) for r in range(world)]
    assert len(shards[0]) == len(shards[1]) == 8  # ZeRO-3: every rank runs the same number of forwards
    valid = [i for s in shards for i, ok in s.indices if ok]
    assert sorted(valid) == list(range(n))  # every sample counted exactly once


def test_every_data_format_has_one_reader():
    """prepare_data looks a task's reader up by its data format (zerotrain/data/datasets.py READERS): every format of
    the task registry has one, keyed by its own format; an unknown format is refused naming the readers."""
    from zerotrain.data.datasets import READERS, reader_for
    from zerotrain.tasks import IMPLIED_TASKS, TASKS

    assert {t.data_format for t in (*TASKS.values(), *IMPLIED_TASKS.values())} == set(READERS)
    assert all(reader_for(name).data_format == name for name in READERS)
    with pytest.raises(ValueError, match="no reader reads data format 'audio'"):
        reader_for("audio")
