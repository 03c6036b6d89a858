"""Probe behind zerotrain/data/streaming.py's choice: is datasets' IterableDataset.state_dict() / torchdata's
StatefulDataLoader exact with a shuffle buffer, and does a second resume continue (datasets#8308)? torchdata is no
dependency of zerotrain: install it aside and put it on the path first.

    pip install --no-deps --target /tmp/td torchdata==0.11.0
    HF_DATASETS_OFFLINE=1 PYTHONPATH=/tmp/td python benchmarks/results/streaming_resume_probe/probe.py \
        > benchmarks/results/streaming_resume_probe/probe_log.txt
"""
import json
import tempfile
import datasets
datasets.disable_progress_bars()
tmp = tempfile.mkdtemp()
for s in range(2):
    with open(f"{tmp}/p{s}.jsonl", "w") as f:
        for i in range(s, 200, 2):
            f.write(json.dumps({"id": i}) + "\n")
files = [f"{tmp}/p0.jsonl", f"{tmp}/p1.jsonl"]

def make(buf):
    ds = datasets.load_dataset("json", data_files=files, split="train", streaming=True)
    return ds.shuffle(seed=3, buffer_size=buf) if buf else ds

for buf in (0, 16):
    straight = [r["id"] for r in make(buf)]
    ds = make(buf); it = iter(ds); first = [next(it)["id"] for _ in range(50)]; st = ds.state_dict()
    ds2 = make(buf); ds2.load_state_dict(st); it2 = iter(ds2); second = [next(it2)["id"] for _ in range(50)]; st2 = ds2.state_dict()
    ds3 = make(buf); ds3.load_state_dict(st2); third = [r["id"] for r in ds3]
    got = first + second + third
    print(f"datasets state_dict buffer={buf}: exact={got == straight} rows={len(got)} vs {len(straight)} "
          f"missing={len(set(straight)-set(got))} second_resume_restarts={third[:5] == straight[:5]}")

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
    for buf in (0, 16):
        straight = [int(r["id"]) for r in StatefulDataLoader(make(buf), batch_size=None)]
        dl = StatefulDataLoader(make(buf), batch_size=None); it = iter(dl); first = [int(next(it)["id"]) for _ in range(50)]; st = dl.state_dict()
        dl2 = StatefulDataLoader(make(buf), batch_size=None); dl2.load_state_dict(st); it2 = iter(dl2); second = [int(next(it2)["id"]) for _ in range(50)]; st2 = dl2.state_dict()
        dl3 = StatefulDataLoader(make(buf), batch_size=None); dl3.load_state_dict(st2); third = [int(r["id"]) for r in dl3]
        got = first + second + third
        print(f"torchdata StatefulDataLoader buffer={buf}: exact={got == straight} rows={len(got)} vs {len(straight)} "
              f"missing={len(set(straight)-set(got))}")
except ImportError as e:
    print("torchdata:", e)
