"""Damaged data is named: a shard that cannot be read fails the run (exit 1) with one line naming the file and
the part of it that is damaged; data that is empty, lacks a column the config names, or takes a setting no
reader can use is refused (exit 2) before a run folder exists."""

import json
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import ddplab
from conftest import image_tar, main
from ddplab.data.shards import DamagedShard

ROWS = [{"text": f"review {i} {'great' if i % 2 else 'awful'}", "label": i % 2} for i in range(40)]
TINY = [
    "model.name=transformer",
    "model.layers=1",
    "model.dim=16",
    "model.heads=2",
    "data.max_len=8",
    "training.max_steps=2",
    "training.batch_size=4",
    "logging.trackers=[]",
    "logging.progress=false",
]


def _parquet(path: Path, rows=ROWS) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=10)
    return path


def _cut(path: Path, share: float = 0.6) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * share)])
    return path


def _truncated_parquet(folder: Path) -> tuple[Path, str]:
    return _cut(_parquet(folder / "0.parquet")), "damaged parquet shard"


def _damaged_row_group(folder: Path) -> tuple[Path, str]:
    """Row group 2's first column chunk overwritten: the footer, and so the row count, still read."""
    path = _parquet(folder / "0.parquet")
    chunk = pq.ParquetFile(path).metadata.row_group(2).column(0)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(path.read_bytes())
    data[start : start + chunk.total_compressed_size] = b"\xff" * chunk.total_compressed_size
    path.write_bytes(bytes(data))
    return path, "row group 2 of 4"


def _truncated_arrow(folder: Path) -> tuple[Path, str]:
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(ROWS)
    with pa.ipc.new_file(folder / "0.arrow", table.schema) as writer:
        for batch in table.to_batches(max_chunksize=10):
            writer.write_batch(batch)
    return _cut(folder / "0.arrow"), "damaged arrow shard"


def _corrupt_json_line(folder: Path) -> tuple[Path, str]:
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(row) for row in ROWS]
    lines[7] = '{"text": "cut", "label": '
    (folder / "0.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "0.jsonl", "sample 7 (non-blank line 8): JSONDecodeError"


def _truncated_tar(folder: Path) -> tuple[Path, str]:
    path = image_tar(folder / "0.tar")
    # Cut at a member boundary (tarfile reads that as the end) and in the middle of one.
    return _cut(path, 0.6), "damaged tar shard"


@pytest.mark.parametrize(
    "make", [_truncated_parquet, _damaged_row_group, _truncated_arrow, _corrupt_json_line, _truncated_tar]
)
def test_a_damaged_shard_fails_the_run_naming_the_file_and_the_damage(tmp_path, monkeypatch, capfd, make):
    monkeypatch.chdir(tmp_path)
    path, words = make(tmp_path / "bad")
    if path.suffix == ".tar":
        data = ["data.name=image_folder", "model.name=cnn", "data.num_classes=2", "data.image_size=8"]
    else:
        data = ["data.name=text_files", *TINY[:5], f"data.val={_parquet(tmp_path / 'good' / '0.parquet')}"]
    code = main("train", *data, *TINY[5:], "data.stream=true", f"data.train={path.parent}")
    err = capfd.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1, err
    assert str(path) in err and words in err, err


@pytest.mark.parametrize("cut", ["header", "inside a member", "at a boundary", "before the end block"])
def test_a_tar_cut_anywhere_is_named_as_damaged(tmp_path, cut):
    """tarfile ends quietly at a header cut short: each cut, at a member's boundary or inside one, is seen."""
    path = image_tar(tmp_path / "t" / "0.tar")
    with tarfile.open(path) as tar:
        members = tar.getmembers()
    sixth = members[5]  # a header block, then its data padded to 512 bytes
    at = {
        "header": sixth.offset + 100,
        "inside a member": sixth.offset_data + sixth.size // 2,
        "at a boundary": sixth.offset,
        "before the end block": members[-1].offset_data + members[-1].size,
    }[cut]
    path.write_bytes(path.read_bytes()[:at])
    with pytest.raises(DamagedShard, match=rf"damaged tar shard {path}.*(member|cut short)"):
        list(ddplab.Shards(path))


def test_an_intact_tar_reads_whole(tmp_path):
    assert len(ddplab.Shards(image_tar(tmp_path / "t" / "0.tar"))) == 8


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("empty shards", "hold no samples"),
        ("0-row parquet", "hold no samples"),
        ("0-row parquet file", "holds no rows"),
        ("val without the text column", "data.text_column: {val} has no column 'text'"),
        ("corrupt json file", "data.train: cannot read"),
    ],
)
def test_data_that_cannot_train_is_refused_before_a_run_folder(tmp_path, monkeypatch, capfd, case, words):
    monkeypatch.chdir(tmp_path)
    good = _parquet(tmp_path / "good" / "0.parquet")
    val = tmp_path / "val"
    val.mkdir()
    if case == "empty shards":
        (val / "0.jsonl").write_text("")
        (val / "1.jsonl").write_text("\n\n")
    elif case.startswith("0-row parquet"):
        pq.write_table(pa.Table.from_pylist(ROWS).slice(0, 0), val / "0.parquet")
    elif case == "val without the text column":
        _parquet(val / "0.parquet", [{"body": r["text"], "label": r["label"]} for r in ROWS])
    else:
        (val / "0.jsonl").write_text('{"text": "a", "label": 0}\n{"text": \n')
    if case in ("0-row parquet file", "corrupt json file"):  # read whole, not streamed
        split = next(val.iterdir())
        args = [f"data.train={split}", f"data.val={good}"]
    else:
        args = ["data.stream=true", f"data.train={good.parent}", f"data.val={val}"]
    assert main("train", "data.name=text_files", *TINY, *args) == 2
    err = capfd.readouterr().err.strip()
    assert words.format(val=val) in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "experiments").exists()


@pytest.mark.parametrize("window", [float("nan"), 0, 2.5, "10", None])
def test_a_window_no_reader_can_use_is_refused(tmp_path, window):
    with pytest.raises(ddplab.UserError, match="window must be a whole number of rows"):
        ddplab.Shards(_parquet(tmp_path / "0.parquet"), window=window)


def test_shards_with_a_nan_window_refuse_the_run_before_a_run_folder(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    _parquet(tmp_path / "s" / "0.parquet")
    (tmp_path / "data.py").write_text(
        "import ddplab\n"
        "def data(cfg):\n"
        "    return ddplab.Data(train=ddplab.Shards('s', window=float('nan')), task=ddplab.Classification(2))\n"
    )
    model = f"model.name={Path(__file__).with_name('shards_workloads.py')}:recorder"
    assert main("train", "data.name=data.py:data", model, f"model.options.log={tmp_path}", *TINY[5:]) == 2
    err = capfd.readouterr().err.strip()
    assert "window must be a whole number of rows, at least 1, not nan" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "experiments").exists()
