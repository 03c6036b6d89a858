"""zerotrain.data.streaming (--streaming), no ranks: a streamed local file gives the map-style path's blocks, two
simulated ranks read every row once per epoch, a loader rebuilt from its checkpoint state (twice in a row) continues
exactly, start-up tokenizes a bounded number of rows whatever the corpus size, and the refusals. The 2-rank CLI
stop/resume/stop/resume runs: tests/multirank/test_streaming.py."""
from __future__ import annotations

import json
import random

import pytest

from zerotrain.cli import main as cli_main
from zerotrain.config.load import build_config
from zerotrain.data.datasets import prepare_data
from zerotrain.data.streaming import TOKENIZE_CHUNK, Position, StreamLoader, prepare_stream, resume_position
from zerotrain.errors import ConfigError, UserError
from tests.unit.test_data import _cache, tokenizer  # noqa: F401 - the demo tokenizer and a fresh cache per test

WORDS = "the cat sat on a mat while dogs ran far away under bright blue skies and green hills".split()
CHATS = [[{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello friend"}],
         [{"role": "system", "content": "be brief"}, {"role": "user", "content": "how are you"},
          {"role": "assistant", "content": "fine thanks"}, {"role": "user", "content": "bye"},
          {"role": "assistant", "content": "bye now"}]]


def texts(n: int, seed: int = 0) -> list[dict]:
    """n documents of 1-40 words (an empty one now and then), each naming its row."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        body = "" if i % 37 == 5 else " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
        rows.append({"text": f"doc{i} {body}" if body else "", "id": i})
    return rows


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def cfg_of(path: str, **over):
    return build_config(overrides={"data.path": path, "data.seq_len": 16, "data.streaming": True,
                                   "run.max_steps": 10, **over})


def blocks(source, rank=0, world=1, epoch=0, at=Position(0, 0)):
    return [b for b, _ in source.blocks(rank, world, epoch, at)]


@pytest.mark.parametrize("mode", ["text-packed", "text-unpacked", "chat-packed", "chat"])
def test_unshuffled_stream_gives_the_map_style_blocks(tmp_path, tokenizer, mode):
    if mode.startswith("chat"):
        rows = [{"messages": CHATS[i % 2]} for i in range(60)]
        over = {"data.chat_template": "chatml", "data.seq_len": 64,
                **({"data.packing": "separate"} if mode == "chat-packed" else {})}
    else:
        rows, over = texts(300), ({"data.pack": False} if mode == "text-unpacked" else {})
    path = write(tmp_path / "d.jsonl", rows)
    streamed = prepare_stream(cfg_of(path, **over), tokenizer)
    mapped = prepare_data(cfg_of(path, **{**over, "data.streaming": False}), tokenizer).train
    got = blocks(streamed.train)
    assert len(got) == len(mapped) > 10
    assert got == [{k: mapped[i][k] for k in got[0]} for i in range(len(mapped))]
    assert set(got[0]) == set(mapped.column_names)
    with pytest.raises(TypeError, match="a stream has no length"):
        len(streamed.train)


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_two_ranks_read_every_row_once_per_epoch(tmp_path, tokenizer, shards):
    """1 and 3 shards on 2 ranks: every rank reads every row and keeps one in two; 2 shards: one file per rank."""
    rows = texts(200)
    for s in range(shards):
        write(tmp_path / f"part-{s}.jsonl", rows[s::shards])
    source = prepare_stream(cfg_of(str(tmp_path / "part-*.jsonl"), **{"data.shuffle_buffer": 16}), tokenizer).train
    orders = []
    for epoch in (0, 1):
        seen = [[r["id"] for r in source.rows(rank, 2, epoch)] for rank in (0, 1)]
        assert set(seen[0]).isdisjoint(seen[1])
        assert sorted(seen[0] + seen[1]) == list(range(200))  # every row once in the epoch, over both ranks
        orders.append(seen[0])
    assert orders[0] != orders[1]  # set_epoch reseeds the shuffle buffer


def run_loader(source, n, state=None, rank=0, world=1, micro=3):
    """(the first n micro-batches' input_ids, the checkpoint state after them) of a fresh loader from `state`."""
    loader = StreamLoader(source, rank, world, micro, lambda rows: [r["input_ids"] for r in rows], state,
                          agree=lambda full: full)
    out = [next(loader) for _ in range(n)]
    return out, loader.checkpoint_state(), loader.epoch


@pytest.mark.parametrize("mode", ["text-packed", "chat-packed"])
def test_state_round_trip_is_exact_twice_in_a_row(tmp_path, tokenizer, mode):
    """A loader stopped at batch k, rebuilt from its state, stopped again and rebuilt again gives the straight
    loader's batches, across epoch ends, with a shuffle buffer and 2 ranks (rank 1's share); the second resume does
    not start over (datasets#8308)."""
    if mode == "chat-packed":
        path = write(tmp_path / "c.jsonl", [{"messages": CHATS[i % 2]} for i in range(80)])
        over = {"data.chat_template": "chatml", "data.seq_len": 48, "data.packing": "separate"}
    else:
        path, over = write(tmp_path / "t.jsonl", texts(40)), {}
    source = prepare_stream(cfg_of(path, **{"data.shuffle_buffer": 8, **over}), tokenizer).train
    n = 40
    straight, _, epoch = run_loader(source, n, rank=1, world=2)
    assert epoch >= 2, "the run must cross epoch ends"
    first, s1, _ = run_loader(source, 7, rank=1, world=2)
    assert s1["rows"][1] > 0 and s1["dp"] == 2
    second, s2, _ = run_loader(source, 18, s1, rank=1, world=2)
    third, _, _ = run_loader(source, n - 25, s2, rank=1, world=2)
    assert first + second + third == straight
    assert source.skipped > 0  # the resumes replayed rows without tokenizing them


def test_a_text_position_inside_a_document_resumes_mid_document(tmp_path, tokenizer):
    source = prepare_stream(cfg_of(write(tmp_path / "t.jsonl", texts(50))), tokenizer).train
    after = [pos for _, pos in source.blocks(0, 1, 0)]
    assert any(p.offset > 0 for p in after)  # blocks end inside documents: the offset is needed
    all_blocks = blocks(source)
    for i in (0, 3, 11):
        assert blocks(source, at=after[i]) == all_blocks[i + 1:]


def test_one_loader_worker_gives_the_same_batches_and_positions(tmp_path, tokenizer):
    source = prepare_stream(cfg_of(write(tmp_path / "t.jsonl", texts(120)), **{"data.shuffle_buffer": 8}),
                            tokenizer).train
    straight, state, _ = run_loader(source, 25)
    loader = StreamLoader(source, 0, 1, 3, lambda rows: [r["input_ids"] for r in rows], workers=1)
    assert [next(loader) for _ in range(25)] == straight and loader.checkpoint_state() == state
    with pytest.raises(UserError, match="exact with 0 or 1 worker"):
        StreamLoader(source, 0, 1, 3, list, workers=2)


def test_start_up_tokenizes_a_bounded_number_of_rows(tmp_path, tokenizer):
    """The CI form of the start-up benchmark: rows tokenized before step 1 do not grow with the corpus (10x)."""
    counts = []
    for n in (2_000, 20_000):
        path = write(tmp_path / f"c{n}.jsonl", texts(n))
        source = prepare_stream(cfg_of(path, **{"data.shuffle_buffer": 64}), tokenizer).train
        loader = StreamLoader(source, 0, 1, 4, list, agree=lambda full: full)
        next(loader)
        counts.append(source.tokenized)
    assert counts[0] == counts[1] == TOKENIZE_CHUNK


def test_refusals(tmp_path, tokenizer, capsys):
    path = write(tmp_path / "t.jsonl", texts(20))
    with pytest.raises(ConfigError, match=r"^--streaming needs --max-steps: .*pass --max-steps N$"):
        build_config(overrides={"data.path": path, "data.streaming": True})
    for task in ("seq-cls", "dpo", "kto", "reward", "grpo"):
        with pytest.raises(ConfigError, match=rf"^--streaming with --task {task}: only causal-lm"):
            build_config(overrides={"data.streaming": True, "run.max_steps": 5, "model.task": task})
    with pytest.raises(ConfigError, match=r"^data.shuffle_buffer=64 \(--shuffle-buffer\) shuffles a stream; .*"
                                          "pass --streaming"):
        build_config(overrides={"data.shuffle_buffer": 64})
    with pytest.raises(ConfigError, match=r"^--eval-split 0.1 with --streaming"):
        build_config(overrides={"data.streaming": True, "run.max_steps": 5, "data.eval_split": 0.1})
    with pytest.raises(ConfigError, match=r"^--loader-workers 2 with --streaming: .*pass --loader-workers 1$"):
        build_config(overrides={"data.streaming": True, "run.max_steps": 5, "data.loader_workers": 2})
    with pytest.raises(ConfigError, match=r"^--data-weights 0.7,0.3 with --streaming: a mixture of streams is not "
                                          r"built yet .*or drop --data-weights$"):
        build_config(overrides={"data.path": f"{path},{path}", "data.data_weights": "0.7,0.3",
                                "data.streaming": True, "run.max_steps": 5})
    with pytest.raises(UserError, match="no file matches"):
        prepare_stream(cfg_of(str(tmp_path / "none-*.jsonl")), tokenizer)
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "zerotrain-data.json").write_text("{}")  # data.prepared.MANIFEST: what `data prepare` writes last
    with pytest.raises(UserError, match=r"written by `zerotrain data prepare` .*drop --streaming$"):
        prepare_stream(cfg_of(str(prepared)), tokenizer)
    source = prepare_stream(cfg_of(path), tokenizer).train
    state = run_loader(source, 1, world=1, micro=1)[1]
    with pytest.raises(UserError, match=r"^--resume with --streaming on 2 data-parallel ranks: .* resume on 1 "):
        resume_position(state, source, 0, 2)
    source.shuffle_buffer = 8
    with pytest.raises(UserError, match=r"^--resume: the checkpoint streamed with --shuffle-buffer 0, this run has"):
        resume_position(state, source, 0, 1)
    for argv, line in ((["--streaming"], "--streaming needs --max-steps"),
                       (["--shuffle-buffer", "64"], "data.shuffle_buffer=64 (--shuffle-buffer) shuffles a stream")):
        assert cli_main(["train", *argv, "--output", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and line in err[0], err
    # launch --elastic MIN:MAX may restart on another world: refused at start; N:N restarts on the same world
    assert cli_main(["launch", "--elastic", "1:2", "--print", "torchrun", "--", "train", "--streaming",
                     "--max-steps", "5", "--save-every", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--elastic 1:2 with --streaming: a restart on another number of nodes" in err[0], err
    assert cli_main(["launch", "--elastic", "2:2", "--print", "torchrun", "--", "train", "--streaming",
                     "--max-steps", "5", "--save-every", "1"]) == 0


def test_eval_data_is_read_whole_beside_the_stream(tmp_path, tokenizer):
    path = write(tmp_path / "t.jsonl", texts(100))
    ev = write(tmp_path / "e.jsonl", texts(30, seed=1))
    data = prepare_stream(cfg_of(path, **{"data.eval_path": ev}), tokenizer)
    mapped = prepare_data(build_config(overrides={"data.path": ev, "data.seq_len": 16}), tokenizer).train
    assert data.eval["input_ids"] == mapped["input_ids"] and "/ %d eval" % len(mapped) in data.description
