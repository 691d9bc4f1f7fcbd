"""Text classification data: hash tokenizer, sources tokenised into HF's Arrow cache, pre-launch checks."""

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from ddplab.data.text_sources import generate
from ddplab.engine.loop.setup import build_data
from ddplab.engine.parallel.distributed import DistContext, LaunchInfo
from ddplab.errors import UserError
from ddplab.registry import load_config, workload
from ddplab.workloads.text_classification import HashTokenizer

ONE = DistContext(LaunchInfo("none"), None, torch.device("cpu"))


def bundle_for(tmp_path, *overrides):
    cfg = load_config(None, ["model.name=transformer", f"experiment.output_dir={tmp_path}", *overrides])
    return build_data(cfg, ONE, workload(cfg))


# ---------------------------------------------------------------------------- hash tokenizer


def test_hash_tokenizer_splits_lowercases_and_truncates():
    tok = HashTokenizer(vocab_size=1000, max_len=8)
    a = tok.encode("Hello, World! It's")
    assert a == tok.encode("hello , world ! it ' s")  # punctuation marks are tokens of their own
    assert a[0] == HashTokenizer.CLS and len(a) == 1 + 7
    assert all(HashTokenizer.RESERVED <= i < 1000 for i in a[1:])
    assert tok.encode("good") != tok.encode("bad")
    ids = tok.encode_batch(["one two", "word " * 500, ""])
    assert list(map(len, ids)) == [3, 8, 1] and ids[2] == [HashTokenizer.CLS]


def test_hash_ids_are_the_same_in_every_process():
    code = (
        "from ddplab.workloads.text_classification import HashTokenizer; "
        "print(HashTokenizer(30000, 16).encode('Rank zero and rank one agree, always.'))"
    )
    seed = str(hash("seed") % 1000 + 1)  # another string-hash seed than this process's
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONHASHSEED": seed},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == str(HashTokenizer(30000, 16).encode("Rank zero and rank one agree, always."))


# ---------------------------------------------------------------------------- synthetic reviews + cache


def test_synthetic_reviews_are_reproducible_in_any_chunking():
    texts, labels = generate(7, 0, 2500, 2)
    part, part_labels = generate(7, 1200, 900, 2)
    assert part == texts[1200:2100] and (part_labels == labels[1200:2100]).all()
    assert 0.4 < labels.mean() < 0.6 and all(40 <= len(t.split()) <= 170 for t in texts[:50])


def test_generated_reviews_are_tokenised_once_into_hf_cache(tmp_path):
    import datasets

    args = ("data.name=synthetic_reviews", "data.num_samples=300", "data.max_len=32")
    b = bundle_for(tmp_path, *args)
    assert isinstance(b.train, datasets.Dataset) and isinstance(b.val, datasets.Dataset)
    assert len(b.train) == 270 and len(b.val) == 30 and b.test is None
    files = {f["filename"] for f in b.train.cache_files}
    assert files and all(f.startswith(str(tmp_path / ".cache")) for f in files)  # memory-mapped Arrow files
    assert len(pickle.dumps(b.train)) < 20_000  # DataLoader workers get the paths and row order, not the data
    written = {f: f.stat().st_mtime_ns for f in (tmp_path / ".cache").rglob("*.arrow")}
    again = bundle_for(tmp_path, *args)
    assert {f: f.stat().st_mtime_ns for f in (tmp_path / ".cache").rglob("*.arrow")} == written  # reused
    assert [again.train[i]["input_ids"].tolist() for i in range(5)] == [
        b.train[i]["input_ids"].tolist() for i in range(5)
    ]
    bundle_for(tmp_path, "data.name=synthetic_reviews", "data.num_samples=300", "data.max_len=64")
    assert len(list((tmp_path / ".cache").rglob("cache-ddplab-*.arrow"))) > len(
        [f for f in written if f.name.startswith("cache-ddplab-")]
    )  # other tokenizer settings, other cache files

    item = b.train[0]
    assert item["input_ids"].dtype == torch.long and item["input_ids"][0] == HashTokenizer.CLS
    batch = b.collate_fn([b.train[i] for i in range(4)])
    width = max(len(b.train[i]["input_ids"]) for i in range(4))
    assert batch["input_ids"].shape == (4, width) == batch["attention_mask"].shape
    assert batch["attention_mask"].sum().item() == sum(len(b.train[i]["input_ids"]) for i in range(4))
    assert b.meta["input"] == "text" and b.meta["label_names"] == ["negative", "positive"]
    # Inference encodes a raw text exactly as training did; train and val split the generated rows.
    texts, labels = generate(1337, 0, 300, 2)  # the default experiment.seed
    tok = HashTokenizer(b.meta["vocab_size"], b.meta["max_len"])
    rows = lambda split: [(tuple(r["input_ids"].tolist()), int(r["label"])) for r in split]  # noqa: E731
    assert sorted(rows(b.train) + rows(b.val)) == sorted(
        zip(map(tuple, map(tok.encode, texts)), labels.tolist(), strict=True)
    )
    assert torch.equal(b.preprocess(texts[0])["input_ids"], torch.tensor(tok.encode(texts[0])))


@pytest.fixture
def reviews(tmp_path):
    texts, labels = generate(3, 0, 60, 2)
    frame = pd.DataFrame({"review": texts, "stars": np.where(labels == 1, "good", "bad")})
    frame.to_csv(tmp_path / "train.csv", index=False)
    frame.iloc[:20].to_json(tmp_path / "test.jsonl", orient="records", lines=True)
    frame.iloc[20:45].to_parquet(tmp_path / "val.parquet")
    return tmp_path, frame


def test_text_files_read_csv_json_parquet_with_string_labels(reviews):
    folder, frame = reviews
    b = bundle_for(
        folder,
        "data.name=text_files",
        f"data.train={folder / 'train.csv'}",
        f"data.val={folder / 'val.parquet'}",
        f"data.test={folder / 'test.jsonl'}",
        "data.text_column=review",
        "data.label_column=stars",
        "data.max_len=16",
    )
    assert (len(b.train), len(b.val), len(b.test)) == (60, 25, 20) and b.num_classes == 2
    assert b.meta["label_names"] == ["bad", "good"]
    labels = [int(b.test[i]["label"]) for i in range(20)]
    assert labels == [int(s == "good") for s in frame["stars"][:20]]
    # A Parquet row is read as the text it holds.
    assert torch.equal(b.val[0]["input_ids"], b.preprocess(frame["review"][20])["input_ids"])


def test_data_limit_caps_every_split(reviews):
    folder, _ = reviews
    b = bundle_for(
        folder,
        "data.name=text_files",
        f"data.train={folder / 'train.csv'}",
        f"data.test={folder / 'test.jsonl'}",
        "data.text_column=review",
        "data.label_column=stars",
        "data.limit=10",
    )
    assert (len(b.train), len(b.val), len(b.test)) == (10, 6, 10)


# ---------------------------------------------------------------------------- checks before launch


@pytest.mark.parametrize(
    "overrides, words",
    [
        (
            ["model.name=hf", "model.pretrained=/no/such/model", "data.name=synthetic_reviews"],
            ["model.pretrained", "/no/such/model"],
        ),
        (["model.name=hf", "data.name=synthetic_reviews"], ["model.pretrained"]),
        (
            [
                "model.name=hf",
                "model.pretrained=bert-base-uncased",
                "data.name=synthetic_reviews",
                "data.tokenizer=hash",
            ],
            ["data.tokenizer=hash", "hf"],
        ),
        (["model.name=transformer", "data.name=synthetic_reviews", "data.tokenizer=hf"], ["data.tokenizer=hf", "hash"]),
        (["model.name=transformer", "data.name=synthetic_reviews", "data.tokenizer=char"], ["data.tokenizer", "hash"]),
        (["model.name=transformer"], ["data.name", "synthetic_reviews"]),
        (["model.name=gpt", "data.name=imdb"], ["model.name", "transformer"]),
        (["model.name=transformer", "data.name=text_files"], ["data.train"]),
        (["model.name=transformer", "data.name=text_files", "data.train=/no/such.csv"], ["data.train", "/no/such.csv"]),
        (["model.name=transformer", "data.name=synthetic_reviews", "data.num_classes=1"], ["data.num_classes"]),
    ],
)
def test_bad_text_configs_name_the_field(overrides, words):
    with pytest.raises(UserError) as err:
        load_config(None, overrides)
    assert "\n" not in str(err.value)
    for word in words:
        assert word in str(err.value)


def test_folder_that_is_not_a_model(tmp_path):
    with pytest.raises(UserError, match="not a Hugging Face model folder"):
        load_config(None, ["model.name=hf", f"model.pretrained={tmp_path}", "data.name=synthetic_reviews"])


@pytest.mark.parametrize(
    "labels, num_classes, words",
    [
        ([0, 1, 2, 1], 2, ["label 2", "data.num_classes=2"]),
        ([0, -1, 1, 1], None, ["label -1"]),
        (["a", "b", "c", "a"], 2, ["3 distinct labels", "data.num_classes=2"]),
    ],
)
def test_labels_that_do_not_fit(tmp_path, labels, num_classes, words):
    path = tmp_path / "d.csv"
    pd.DataFrame({"text": ["x y", "z", "w", "v"], "label": labels}).to_csv(path, index=False)
    extra = [f"data.num_classes={num_classes}"] if num_classes else []
    with pytest.raises(UserError) as err:
        load_config(None, ["model.name=transformer", "data.name=text_files", f"data.train={path}", *extra])
    for word in words:
        assert word in str(err.value)


def test_hub_dataset_offline_says_how_to_get_it(tmp_path, monkeypatch):
    with pytest.raises(UserError) as err:
        bundle_for(tmp_path, "data.name=imdb", f"data.cache_dir={tmp_path / 'hf'}")
    message = str(err.value)
    assert "\n" not in message and "data.download=true" in message and "data.name=text_files" in message
    assert json.dumps(message)  # plain text


def test_a_rank_that_cannot_see_the_built_cache_says_so(tmp_path):
    """Rank 1 of a node whose output folder differs from rank 0's: one line, not a missing-file traceback."""
    import types

    from ddplab.data.text_cache import ensure
    from ddplab.errors import UserError

    rank1 = types.SimpleNamespace(
        rank=1, local_rank=1, is_main=False, gather_objects=lambda obj: [None, obj]
    )  # rank 0 built and sees its copy
    with pytest.raises(UserError, match=r"rank\(s\) \[1\] cannot see it.*experiment.output_dir"):
        ensure(rank1, tmp_path / "not-here", build=lambda: None)


# ---------------------------------------------------------------------------- hub datasets through Dataset.map


def _fake_hub(tmp_path, monkeypatch, name: str) -> list:
    """A small on-disk DatasetDict shaped like the hub's `name`, returned by datasets.load_dataset; its
    Arrow files let Dataset.map cache beside them as beside a download. Returns the texts mapped."""
    import datasets

    rng = np.random.default_rng(0)
    labels = datasets.ClassLabel(names=["neg", "pos"])

    def split(n: int, label: bool = True) -> datasets.Dataset:
        words = [" ".join(rng.choice(["good", "bad", "fine", "plot"], size=int(rng.integers(2, 12)))) for _ in range(n)]
        cols = {"text": words} if name == "imdb" else {"title": [w[:4] for w in words], "content": words}
        cols["label"] = [int(x) for x in rng.integers(0, 2, n)] if label else [-1] * n
        features = {k: datasets.Value("string") for k in cols if k != "label"}
        return datasets.Dataset.from_dict(cols, features=datasets.Features({**features, "label": labels}))

    parts = {"train": split(40), "test": split(12)} | ({"unsupervised": split(5, False)} if name == "imdb" else {})
    datasets.DatasetDict(parts).save_to_disk(tmp_path / "hub")
    loaded = datasets.load_from_disk(str(tmp_path / "hub"))
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: loaded)
    calls: list = []
    real_map = datasets.Dataset.map
    monkeypatch.setattr(datasets.Dataset, "map", lambda self, *a, **k: calls.append(k) or real_map(self, *a, **k))
    return calls


@pytest.mark.parametrize("name", ["imdb", "amazon_polarity"])
def test_hub_sources_are_hf_datasets_tokenised_once_by_map(tmp_path, monkeypatch, name):
    import datasets

    from ddplab.engine.loop.setup import build_model
    from ddplab.tasks import call_model

    calls = _fake_hub(tmp_path, monkeypatch, name)
    args = (f"data.name={name}", "data.val_fraction=0.25", "model.layers=1", "model.dim=16", "model.heads=2")
    data = bundle_for(tmp_path / "run", *args)
    train, val, test = data.train, data.val, data.test
    assert all(isinstance(s, datasets.Dataset) for s in (train, val, test)) and len(test) == 12
    assert data.meta["label_names"] == ["neg", "pos"]
    item = train[0]
    assert set(item) == {"input_ids", "label"} and item["input_ids"][0] == HashTokenizer.CLS

    # train and val split the hub's train: together its tokenised texts, each text once
    hub = datasets.load_dataset(name)["train"]
    texts = hub["text"] if name == "imdb" else [f"{t}\n{c}" for t, c in zip(hub["title"], hub["content"], strict=True)]
    tok = HashTokenizer(data.meta["vocab_size"], data.meta["max_len"])
    rows = lambda split: [(tuple(r["input_ids"].tolist()), int(r["label"])) for r in split]  # noqa: E731
    assert len(val) == 10 and len(train) == 30
    assert sorted(rows(train) + rows(val)) == sorted(zip(map(tuple, map(tok.encode, texts)), hub["label"], strict=True))

    mapped = [k["new_fingerprint"] for k in calls]  # IMDB's unlabelled "unsupervised" split is not read
    assert len(mapped) == 2 and all(f.startswith("ddplab-") for f in mapped)
    written = {f: f.stat().st_mtime_ns for f in (tmp_path / "hub").rglob("cache-*.arrow")}
    assert len(written) == 2 and {f["filename"] for f in train.cache_files} & set(map(str, written))
    again = bundle_for(tmp_path / "run2", *args).train  # another run: the same cache files, no re-tokenising
    assert [k["new_fingerprint"] for k in calls[len(mapped) :]] == mapped
    assert {f: f.stat().st_mtime_ns for f in (tmp_path / "hub").rglob("cache-*.arrow")} == written
    assert again.cache_files == train.cache_files

    batch = data.collate_fn([train[i] for i in range(4)])
    assert set(batch) == {"input_ids", "attention_mask", "labels"} and batch["labels"].shape == (4,)
    cfg = load_config(None, ["model.name=transformer", f"experiment.output_dir={tmp_path}", *args])
    output = call_model(build_model(cfg, ONE, workload(cfg), data), batch)
    assert output.shape == (4, 2) and torch.isfinite(data.task.loss(output, batch["labels"]))


def test_a_run_on_a_hub_source_trains_and_predicts(tmp_path, monkeypatch, capfd):
    """The fake IMDB through ddplab.train in this process, then `ddplab predict` rebuilding its preprocessing."""
    import ddplab
    from conftest import main

    _fake_hub(tmp_path, monkeypatch, "imdb")
    tiny = ("model.layers=1", "model.dim=16", "model.heads=2", "data.max_len=16", "training.batch_size=8")
    out = tmp_path / "runs"
    args = ["data.name=imdb", "model.name=transformer", *tiny, "training.max_steps=3", f"experiment.output_dir={out}"]
    summary = ddplab.train(None, [*args, "experiment.name=hub"])
    assert summary["status"] == "complete"
    capfd.readouterr()
    assert main("predict", str(out / "hub"), "a good plot", "bad") == 0
    printed = capfd.readouterr().out
    assert "a good plot" in printed and ("neg" in printed or "pos" in printed)


@pytest.mark.parametrize(
    "rank, local, order",
    [
        (0, 0, ["build", "barrier", "barrier"]),
        (1, 1, ["barrier", "barrier", "build"]),
        (2, 0, ["barrier", "build", "barrier"]),  # the first rank of the second node
    ],
)
def test_without_a_folder_every_rank_builds_one_rank_a_node_first(rank, local, order):
    """ensure(folder=None), the hub path: one rank a node maps first, the others after it (reusing HF's cache)."""
    import types

    from ddplab.data.text_cache import ensure

    seen: list = []
    ctx = types.SimpleNamespace(
        rank=rank, local_rank=local, is_main=rank == 0, gather_objects=lambda obj: seen.append("barrier") or [obj]
    )
    ensure(ctx, None, build=lambda: seen.append("build"))
    assert seen == order
