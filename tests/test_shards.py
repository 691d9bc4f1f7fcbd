"""ddplab.Shards: each format read, an order that depends on (seed, epoch) alone whatever the ranks and
loader workers, and a streamed run SIGKILLed mid-epoch resumed at 2 and at 1 process with exactly the
samples of an uninterrupted run (tests/shards_workloads.py holds the workload); the built-in text, text_files
and image_folder data streamed through it (data.stream)."""

import contextlib
import gzip
import io
import json
import shutil
import subprocess
import tarfile
from collections import Counter
from itertools import islice
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import ddplab
from conftest import _env, assert_ok, image_tar, main
from conftest import ddplab as run_ddplab
from ddplab.data.stream import Stream, owns
from faults import command

HERE = Path(__file__).resolve().parent
WORK = HERE / "shards_workloads.py"
SIZES = [15, 20, 25, 17, 19]  # 96 rows in 5 shards of uneven length


def _parquet(folder: Path, sizes=SIZES) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    start = 0
    for k, n in enumerate(sizes):
        rows = range(start, start + n)
        pq.write_table(
            pa.table({"idx": list(rows), "text": [f"row {i}" for i in rows]}),
            folder / f"{k:03}.parquet",
            row_group_size=6,
        )
        start += n
    return folder


def _write(folder: Path, fmt: str) -> list:
    """Three shards of 7 samples in `fmt`, and the 21 items Shards should read from them, in file order."""
    folder.mkdir()
    items = []
    for k in range(3):
        rows = [{"idx": 7 * k + i, "text": f"row {7 * k + i}"} for i in range(7)]
        if fmt == "parquet":
            pq.write_table(pa.Table.from_pylist(rows), folder / f"{k}.parquet", row_group_size=3)
        elif fmt in ("arrow", "arrow_stream"):
            table = pa.Table.from_pylist(rows)
            new = pa.ipc.new_file if fmt == "arrow" else pa.ipc.new_stream
            with new(folder / f"{k}.arrow", table.schema) as writer:
                for batch in table.to_batches(max_chunksize=2):
                    writer.write_batch(batch)
        elif fmt == "json":
            with gzip.open(folder / f"{k}.jsonl.gz", "wt") as f:
                f.write("\n".join(json.dumps(r) for r in rows) + "\n\n")
        elif fmt == "text":
            (folder / f"{k}.txt").write_text("".join(r["text"] + "\n" for r in rows))
            rows = [r["text"] for r in rows]
        else:  # WebDataset: sample <key> is <key>.txt and <key>.cls
            with tarfile.open(folder / f"{k}.tar", "w") as tar:
                for r in rows:
                    for ext, data in (("txt", r["text"]), ("cls", str(r["idx"] % 2))):
                        info = tarfile.TarInfo(f"s/{r['idx']:04}.{ext}")
                        info.size = len(data.encode())
                        tar.addfile(info, io.BytesIO(data.encode()))
            rows = [
                {"__key__": f"s/{r['idx']:04}", "txt": r["text"].encode(), "cls": str(r["idx"] % 2).encode()}
                for r in rows
            ]
        items += rows
    return items


@pytest.mark.parametrize("fmt", ["parquet", "arrow", "arrow_stream", "json", "text", "tar"])
def test_each_format_is_read_in_order_and_shuffled(tmp_path, fmt):
    items = _write(tmp_path / "shards", fmt)
    plain = ddplab.Shards(tmp_path / "shards", shuffle=False, window=4)
    assert len(plain) == 21 and list(plain) == items
    shuffled = ddplab.Shards(str(tmp_path / "shards"), seed=3, window=4)
    order = list(shuffled)
    assert order != items and sorted(map(repr, order)) == sorted(map(repr, items))
    shuffled.set_epoch(1)
    assert list(shuffled) != order  # another epoch, another order
    assert list(ddplab.Shards(f"file://{tmp_path}/shards/*", seed=3, window=4)) == order  # an fsspec URL, a glob


def test_the_window_bounds_how_far_a_sample_moves_within_its_shard(tmp_path):
    shards = ddplab.Shards(_parquet(tmp_path / "p"), seed=0, window=8)
    order, starts = [r["idx"] for r in shards], [0, 15, 35, 60, 77]
    place = {idx: p for p, idx in enumerate(order)}
    for k in shards.order(0):  # each shard's rows are together, each within its own window of 8
        rows = range(starts[k], starts[k] + SIZES[k])
        first = min(place[i] for i in rows)
        assert sorted(place[i] for i in rows) == list(range(first, first + SIZES[k]))
        assert all((place[i] - first) // 8 == (i - starts[k]) // 8 for i in rows)


@pytest.mark.parametrize(
    ("world", "batch", "workers", "start"), [(1, 4, 1, 0), (2, 4, 2, 24), (3, 2, 2, 12), (2, 5, 3, 50), (4, 3, 1, 95)]
)
def test_every_rank_and_worker_reads_its_share_of_one_global_order(tmp_path, world, batch, workers, start):
    """The shares of all ranks and loader workers, from any position, are exactly the global order's
    items that data.stream.owns gives them: the order does not depend on how it is read."""
    shards = ddplab.Shards(_parquet(tmp_path / "p"), seed=5, window=8)
    shards.set_epoch(2)
    order = [r["idx"] for r in shards]
    for rank in range(world):
        for worker in range(workers):
            got = [r["idx"] for r in shards.share(2, start, None, rank, world, batch, worker, workers)]
            assert got == [order[j] for j in range(start, 96) if owns(j - start, rank, world, batch, worker, workers)]


def test_a_loader_with_workers_yields_a_ranks_batches_in_the_global_order(tmp_path):
    shards = ddplab.Shards(_parquet(tmp_path / "p"), seed=1, window=8, columns=["idx"])
    order = [r["idx"] for r in shards]
    stream = Stream(shards, rank=1, world_size=2, batch_size=4)
    stream.set_epoch(0, 24)
    loader = torch.utils.data.DataLoader(stream, batch_size=4, num_workers=2)
    assert torch.cat([b["idx"] for b in loader]).tolist() == order[25::2]


def test_a_folder_without_shards_is_refused(tmp_path):
    with pytest.raises(ddplab.UserError, match="no shard files"):
        ddplab.Shards(tmp_path)


# ---------------------------------------------------------------------------- a run killed and resumed


def _args(data: Path, log: Path, name: str, workers: int = 0) -> list[str]:
    log.mkdir(exist_ok=True)
    return [
        "train",
        f"model.name={WORK}:recorder",
        f"data.name={WORK}:shards_data",
        f"data.options.path={data}",
        f"model.options.log={log}",
        "training.epochs=2",
        "training.batch_size=4",
        "checkpoint.every=5",
        "training.warmup_steps=0",
        "logging.trackers=[]",
        "logging.progress=false",
        "logging.log_every=1",
        "distributed.timeout=60",
        f"data.num_workers={workers}",
        f"experiment.name={name}",
    ]


def _run(cwd: Path, data: Path, log: Path, name: str, spec: str | None = None, workers: int = 0):
    """The job on 2 processes, launched as a user would (`ddplab train --nproc-per-node 2`), or with a
    fault (`spec`, tests/faults.py) under torchrun."""
    args = _args(data, log, name, workers)
    if spec is None:
        return run_ddplab(args[0], "--nproc-per-node", "2", *args[1:], cwd=cwd)
    return subprocess.run(
        command(spec, args, nproc=2), cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300
    )


def _order(log: Path, keep: Path, steps: int | None = None) -> list[int]:
    """The global order of the samples the ranks logged (item i of rank r is global item i*ranks + r),
    from their first `steps` forward passes; the files are moved to `keep`."""
    keep.mkdir()
    ranks = {}
    for f in sorted(log.iterdir()):
        ranks[int(f.name.split(".")[0])] = [int(i) for line in f.read_text().splitlines()[:steps] for i in line.split()]
        f.rename(keep / f.name)
    return [ranks[j % len(ranks)][j // len(ranks)] for j in range(sum(map(len, ranks.values())))]


def test_a_streamed_run_killed_mid_epoch_resumes_at_the_next_global_sample_at_2_and_at_1_process(tmp_path):
    """96 rows, 2 ranks x batches of 4: 12 steps an epoch. Rank 1 is SIGKILLed after step 17 (the snapshot
    of step 15 is 24 samples into epoch 2); the run resumes on 2 processes with 2 loader workers each,
    and a copy of it on 1 process: both go on with the uninterrupted run's next global sample."""
    data, log = _parquet(tmp_path / "data"), tmp_path / "log"
    assert_ok(_run(tmp_path, data, log, "whole"))
    whole = _order(log, tmp_path / "whole")
    assert Counter(whole) == Counter(list(range(96)) * 2)

    assert _run(tmp_path, data, log, "cut", spec="kill_rank=1,step=17").returncode != 0
    before = _order(log, tmp_path / "cut", steps=15)  # up to the snapshot
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "experiments" / "cut", elsewhere / "experiments" / "cut")

    resumed = _run(tmp_path, data, log, "cut", workers=2)
    assert_ok(resumed)
    assert "seeks to sample 24 of epoch 2" in resumed.stdout, resumed.stdout[-2000:]
    assert before + _order(log, tmp_path / "again") == whole

    with contextlib.chdir(elsewhere):  # the copy resumed on 1 process: this one (a process adds nothing)
        assert main(*_args(data, log, "cut")) == 0
    assert before + _order(log, tmp_path / "one") == whole


def test_without_the_text_extra_shards_are_refused_in_one_line(monkeypatch, tmp_path):
    import importlib.util

    from ddplab.errors import UserError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fsspec" else real(name, *a))
    line = r"ddplab.Shards needs fsspec: pip install .*'fsspec\S*'.* \(ddplab's text extra\)$"
    with pytest.raises(UserError, match=line):
        ddplab.Shards(tmp_path)


# ---------------------------------------------------------------------------- the built-in data streamed (data.stream)


def _built(tmp_path, *overrides):
    from ddplab.engine.loop.setup import build_data
    from ddplab.engine.parallel.distributed import DistContext, LaunchInfo
    from ddplab.registry import check_files, load_config, workload

    cfg = load_config(None, [f"experiment.output_dir={tmp_path / 'out'}", "data.stream=true", *overrides])
    check_files(cfg)
    return cfg, build_data(cfg, DistContext(LaunchInfo("none"), None, torch.device("cpu")), workload(cfg))


def _reviews(folder: Path) -> Path:
    """Three Parquet shards of 10 (review, stars) rows, stars a string label; the third holds label 'meh'
    past the first rows only."""
    folder.mkdir()
    for k in range(3):
        rows = [
            {"review": f"review {10 * k + i} {'great' if i % 2 else 'awful'}", "stars": ["bad", "good"][i % 2]}
            for i in range(10)
        ]
        if k == 2:
            rows[-1]["stars"] = "meh"
        pq.write_table(pa.Table.from_pylist(rows), folder / f"{k}.parquet")
    return folder


def test_text_files_stream_from_shards_tokenised_as_read_with_labels_from_the_first_rows(tmp_path, monkeypatch):
    from ddplab.workloads import text_classification
    from ddplab.workloads.text_classification import Encoder

    monkeypatch.setattr(text_classification, "PREFIX", 20)  # the labels are read from the first 20 rows
    shards = _reviews(tmp_path / "reviews")
    columns = ["data.name=text_files", "data.text_column=review", "data.label_column=stars", "model.name=transformer"]
    cfg, b = _built(tmp_path, *columns, f"data.train={shards}/*.parquet", f"data.val={shards / '0.parquet'}")
    assert isinstance(b.train, ddplab.Shards) and (len(b.train), len(b.val)) == (30, 10)
    assert b.meta["label_names"] == ["bad", "good"] and b.num_classes == 2
    raw = ddplab.Shards(shards, seed=cfg.experiment.seed)  # the order any Shards of these files has
    encode = Encoder(b.meta)
    items = list(b.val)
    assert [label for _, label in items] == [i % 2 for i in range(10)]
    assert torch.equal(items[3][0]["input_ids"], encode("review 3 great")["input_ids"])
    order = list(raw)
    meh = next(j for j, row in enumerate(order) if row["stars"] == "meh")
    got = [(inputs["input_ids"].tolist(), label) for inputs, label in islice(b.train, meh)]
    want = [(encode(row["review"])["input_ids"].tolist(), ["bad", "good"].index(row["stars"])) for row in order[:meh]]
    assert got == want and meh > 0
    with pytest.raises(ValueError, match="label 'meh' is not one of the 2 labels learned from the first 20 rows"):
        list(b.train)


def test_text_streams_bytes_one_line_a_sample(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text("hello world\n\nab\n")
    _, b = _built(tmp_path, "data.name=text", "model.name=gpt", "model.context=8", f"data.train={tmp_path / 't'}")
    assert b.meta["tokenizer"] == "byte" and b.vocab_size == 256 and len(b.train) == 2  # blank lines skipped
    (x1, y1), (x2, y2) = list(ddplab.Shards(tmp_path / "t", shuffle=False, transform=b.train.transform))
    assert bytes(x1.tolist()) == b"hello wo" and bytes(y1.tolist()) == b"ello wor"  # cut at context + 1 bytes
    assert bytes(x2[:2].tolist()) == b"ab" and y2.tolist() == [ord("b"), ord("\n")] + [-100] * 6  # padding unscored


def test_image_folder_streams_webdataset_tar_shards(tmp_path):
    image_tar(tmp_path / "i" / "0.tar", samples=6)
    overrides = ["data.name=image_folder", "model.name=cnn", "data.num_classes=2", "data.image_size=8"]
    _, b = _built(tmp_path, *overrides, f"data.train={tmp_path / 'i'}", f"data.test={tmp_path / 'i' / '0.tar'}")
    assert len(b.train) == 6 and b.input_shape == (3, 8, 8) and b.meta["label_names"] == ["0", "1"]
    images, labels = b.collate_fn(list(b.test))
    assert images.shape == (6, 3, 8, 8) and labels.tolist() == [0, 1, 0, 1, 0, 1]
    assert (images[1, 0] > images[0, 0]).all()  # the red image is class 1


def test_a_streamed_builtin_trains_and_predicts_from_its_run_folder(tmp_path, monkeypatch, capfd):

    monkeypatch.chdir(tmp_path)
    shards = _reviews(tmp_path / "reviews")
    (shards / "2.parquet").unlink()  # no 'meh'
    args = ["data.name=text_files", "data.stream=true", "data.train=reviews/*.parquet", "data.val=reviews/1.parquet"]
    tiny = ["model.name=transformer", "model.layers=1", "model.dim=16", "model.heads=2", "data.max_len=8"]
    fast = ["training.epochs=2", "training.batch_size=4", "logging.trackers=[]", "logging.progress=false"]
    assert (
        main("train", *args, "data.text_column=review", "data.label_column=stars", *tiny, *fast, "experiment.name=s")
        == 0
    )
    assert "val_accuracy" in capfd.readouterr().out
    assert main("predict", "experiments/s", "an awful film") == 0
    assert capfd.readouterr().out.split("\t")[0] in ("bad", "good")


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["data.name=digits", "model.name=cnn", "data.train=x"], "data.stream=true streams data.name text"),
        (["data.name=text_files", "model.name=transformer"], "data.stream=true needs data.train="),
        (["data.name=text", "model.name=gpt", "data.train=t", "data.tokenizer=char"], "use data.tokenizer=byte"),
        (["data.name=image_folder", "model.name=cnn", "data.train=t"], "needs data.num_classes"),
        (["data.name=image_folder", "model.name=cnn", "data.root=t", "data.num_classes=2"], "give data.train=t"),
        (["data.name=text_files", "model.name=transformer", "data.train=t"], "t holds text files"),
        (["data.name=text_files", "model.name=transformer", "data.train=t/*.csv"], "no shard files at t/*.csv"),
        (["data.name=text", "model.name=gpt", "data.train=p", "data.text_column=body"], "p has no column 'body'"),
    ],
)
def test_a_streamed_builtin_that_cannot_work_is_refused_in_one_line(tmp_path, monkeypatch, capfd, overrides, words):

    monkeypatch.chdir(tmp_path)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text("a line\n")
    _parquet(tmp_path / "p", [3])
    assert main("train", "data.stream=true", *overrides, "logging.trackers=[]") == 2
    err = capfd.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "experiments").exists()
