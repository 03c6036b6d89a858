"""zerotrain.data.streaming (--streaming), no ranks: a streamed local file gives the map-style path's blocks, two
simulated ranks read every row once per epoch, a loader rebuilt from its checkpoint state (twice in a row) continues
exactly, start-up tokenizes a bounded number of rows whatever the corpus size, and the refusals. A mixture of streams
(--data-weights): each global batch of 2 simulated ranks holds each source's share to within one row, every row of a
source is read once per its pass over both ranks, its state round trip is exact twice in a row across sources'
restarts, and its refusals. The 2-rank CLI
stop/resume/stop/resume runs: tests/multirank/test_streaming.py."""
from __future__ import annotations

import json
import random

import pytest

from zerotrain.cli import main as cli_main
from zerotrain.config.load import build_config
from zerotrain.data.datasets import prepare_data
from zerotrain.data.mixture import SOURCE, SOURCE_COUNTS, Mixture, schedule_window
from zerotrain.data.streaming import (TOKENIZE_CHUNK, MixedStream, Position, StreamLoader, prepare_stream,
                                      resume_mixture, resume_position)
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
    build_config(overrides={"data.path": f"{path},{path}", "data.data_weights": "0.7,0.3",  # a mixture of streams
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


def mixed_source(tmp_path, tokenizer, weights="0.7,0.3", sizes=(60, 14), **over):
    """A streamed mixture of a 2-shard .jsonl glob and a .parquet file (two file types), shuffle buffer 8."""
    import datasets

    rows = texts(sizes[0])
    (tmp_path / "a").mkdir()
    for s in range(2):
        write(tmp_path / "a" / f"part-{s}.jsonl", rows[s::2])
    b = tmp_path / "b.parquet"
    datasets.Dataset.from_list(texts(sizes[1], seed=7)).to_parquet(str(b))
    data = prepare_stream(cfg_of(f"{tmp_path / 'a' / 'part-*.jsonl'},{b}", **{"data.data_weights": weights,
                                                                              "data.shuffle_buffer": 8, **over}),
                          tokenizer)
    assert isinstance(data.train, MixedStream) and data.mixture is data.train.mixture
    return data.train


def mix_loader(source, n, state=None, rank=0, world=2, micro=2, global_batch=8, workers=0):
    """(n micro-batches of rank `rank`: (source of each row, its input_ids), the state after, the loader)."""
    loader = StreamLoader(source, rank, world, micro,
                          lambda rows: {"rows": [(r[SOURCE], r["input_ids"]) for r in rows]}, state, workers=workers, agree=lambda full: full, global_batch=global_batch)
    out = []
    for _ in range(n):
        batch = next(loader)
        counts = batch[SOURCE_COUNTS]
        for s in (0, 1):  # the figures metrics.jsonl reports: each source's tokens and rows of the micro-batch
            assert counts[1, s] == sum(1 for src, _ in batch["rows"] if src == s)
            assert counts[0, s] == sum(len(ids) for src, ids in batch["rows"] if src == s)
        out.append(batch["rows"])
    return out, loader.checkpoint_state(), loader


def test_a_mixture_of_streams_holds_each_global_batch_to_the_schedule(tmp_path, tokenizer):
    """2 simulated ranks, micro-batch 2, grad-accum 2 (global batch 8): every global batch's sources are
    mixture.schedule_window's (the map-style schedule), each source within one row of its share, the run's shares
    within 2% of the weights; the small source restarts many times on each rank and the mixture goes on."""
    source = mixed_source(tmp_path, tokenizer)
    steps = 40
    ranks = [mix_loader(source, 2 * steps, rank=r) for r in (0, 1)]
    counts = [0, 0]
    for k in range(steps):
        window = schedule_window([0.7, 0.3], k, 8, source.seed, 0)
        got = []
        for r in (0, 1):
            got.append([src for mb in ranks[r][0][2 * k:2 * k + 2] for src, _ in mb])
            assert got[r] == list(window[r::2])  # rank r takes positions r, r + 2, ... of the window
        for s, w in ((0, 0.7), (1, 0.3)):
            n = sum(g.count(s) for g in got)
            counts[s] += n
            assert abs(counts[s] - w * 8 * (k + 1)) <= 1  # cumulative share within one row
    assert counts[0] / sum(counts) == pytest.approx(0.7, abs=0.02)
    for r in (0, 1):
        epochs = ranks[r][2].at.epochs
        assert epochs[1] >= 2 and epochs[0] >= 1, epochs  # both sources ran out and restarted on this rank
        assert ranks[r][2].epoch == min(epochs)


def test_every_row_of_a_source_is_read_once_per_its_pass(tmp_path, tokenizer):
    """Unpacked text (one row per document): over both ranks, the rows a source gave in its pass e are that
    source's rows, each once (its map-style rows), for the first passes of both sources; a pass's order changes."""
    source = mixed_source(tmp_path, tokenizer, **{"data.pack": False})
    passes = {}  # (source, pass) -> the rows read
    for r in (0, 1):
        blocks = source.blocks(r, 2, 8, source.start())
        for _ in range(120):
            row, at = next(blocks)
            s = row[SOURCE]
            passes.setdefault((s, at.epochs[s]), []).append(tuple(row["input_ids"]))
    for s, part in enumerate(source.sources):
        mapped = prepare_data(build_config(overrides={"data.path": ",".join(part.files), "data.seq_len": 16,
                                                      "data.pack": False}), tokenizer).train
        want = sorted(tuple(x) for x in mapped["input_ids"])
        full = sorted(e for (src, e) in passes if src == s)[:-1]  # the last pass may be partial
        assert len(full) >= (2 if s == 0 else 4), full
        for e in full:
            assert sorted(passes[(s, e)]) == want, (s, e)
        assert passes[(s, 0)] != passes[(s, 1)]  # reshuffled by seed + epoch


def test_a_mixture_state_round_trip_is_exact_twice_in_a_row(tmp_path, tokenizer):
    """Rank 1 of 2 stopped at micro-batch 7 (the small source has restarted), rebuilt from its state, stopped again
    and rebuilt again gives the straight loader's batches; with a loader worker too."""
    source = mixed_source(tmp_path, tokenizer, sizes=(20, 4))
    n = 60
    straight, _, loader = mix_loader(source, n, rank=1)
    first, s1, _ = mix_loader(source, 17, rank=1)
    assert s1["sources"][1]["epochs"][1] >= 1 and s1["mixed"] == [0, 34]  # source b restarted (rank 1's entries)
    second, s2, _ = mix_loader(source, 21, s1, rank=1, workers=1)
    assert s2["sources"][1]["epochs"][1] > s1["sources"][1]["epochs"][1]  # and restarts again after the resume
    third, s3, _ = mix_loader(source, n - 38, s2, rank=1)
    assert first + second + third == straight
    assert s3 == loader.checkpoint_state()
    assert source.skipped > 0  # the resumes replayed rows without tokenizing them


def test_mixture_of_streams_refusals(tmp_path, tokenizer):
    source = mixed_source(tmp_path, tokenizer)
    state = mix_loader(source, 3)[1]
    other = MixedStream(source.sources, Mixture(source.mixture.names, None, [0.5, 0.5]), source.spec)
    with pytest.raises(UserError, match=r"^--data-weights: the checkpoint streamed the mixture with weights 0.7,0.3, "
                                        r"this run has 0.5,0.5; resume with --data-weights 0.7,0.3$"):
        resume_mixture(state, other, 0, 2, 8)
    with pytest.raises(UserError, match=r"^--resume: the checkpoint mixed its streams by global batches of 8 rows, "
                                        r"this run has 16; pass --global-batch 8$"):
        resume_mixture(state, source, 0, 2, 16)
    with pytest.raises(UserError, match=r"^--resume with --streaming on 4 data-parallel ranks"):
        resume_mixture(state, source, 0, 4, 8)
    single = source.sources[0]
    with pytest.raises(UserError, match=r"^--data-weights: the checkpoint streamed a mixture of .* with weights "
                                        r"0.7,0.3, this run streams one dataset; resume with --data-weights 0.7,0.3$"):
        resume_position({**state, "data": single.spec}, single, 0, 2)
    one = run_loader(single, 1, world=2, micro=1)[1]
    with pytest.raises(UserError, match=r"^--data-weights 0.7,0.3: the checkpoint streamed .* as one dataset, not a "
                                        r"mixture; resume without --data-weights$"):
        resume_mixture({**one, "data": source.spec}, source, 0, 2, 8)
    chat = write(tmp_path / "c.jsonl", [{"messages": CHATS[i % 2]} for i in range(8)])
    with pytest.raises(UserError, match=r"^--data .*: the sources of a mixture must be one kind of data .*mix text "
                                        r"with text and chat with chat$"):
        prepare_stream(cfg_of(f"{single.files[0]},{chat}", **{"data.data_weights": "1,1",
                                                               "data.chat_template": "chatml"}), tokenizer)
    tiny = write(tmp_path / "tiny.jsonl", [{"text": "doc"}])  # fewer tokens than one block of 16
    empty = prepare_stream(cfg_of(f"{single.files[0]},{tiny}", **{"data.data_weights": "1,1"}), tokenizer).train
    loader = StreamLoader(empty, 0, 1, 2, dict, agree=lambda full: full)
    with pytest.raises(UserError, match=r"^--data .*: a data-parallel rank's share of a mixture source yields no row "
                                        r"in a whole epoch .*a smaller --seq-len$"):
        for _ in range(10):
            next(loader)
