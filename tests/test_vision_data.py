"""Image data: digits, torchvision's FashionMNIST reading real IDX files, ImageFolder trees,
the validation transform that `predict` reuses, and bad input caught before launch."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import assert_ok, torchrun
from ddplab.registry import load_config
from ddplab.data import build_data
from ddplab.data.vision import encode_images
from ddplab.errors import UserError

QUIET = ["logging.tensorboard=false", "logging.progress=false"]


def write_idx(path: Path, array: np.ndarray) -> None:
    """The IDX layout torchvision's MNIST reader parses: 0, 0, dtype 0x08 (uint8), ndim, big-endian sizes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def fashion_mnist_root(root: Path, n_train: int = 240, n_test: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """Small FashionMNIST files where torchvision looks: class k is a bright band at rows 2k..2k+3."""
    rng = np.random.default_rng(0)
    out = []
    for split, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = rng.integers(0, 60, (n, 28, 28)).astype(np.uint8)
        for i, k in enumerate(labels):
            images[i, 2 * k + 4: 2 * k + 8] = 230
        write_idx(root / "FashionMNIST" / "raw" / f"{split}-images-idx3-ubyte", images)
        write_idx(root / "FashionMNIST" / "raw" / f"{split}-labels-idx1-ubyte", labels)
        out.append((images, labels))
    return out[0]


def image_tree(root: Path, classes: int = 3, per_class: int = 6, side: int = 32, split: bool = True) -> Path:
    """Tiny PNGs, one colour per class under noise: train/ + val/, or one tree."""
    rng = np.random.default_rng(1)
    colours = [(220, 40, 40), (40, 200, 40), (40, 40, 220), (200, 200, 40)]
    splits = {"train": per_class, "val": 2} if split else {".": per_class}
    for name, n in splits.items():
        for c in range(classes):
            folder = root / name / f"class_{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                pixels = np.array(colours[c])[None, None] + rng.normal(0, 25, (side, side, 3))
                Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(folder / f"{i}.png")
    return root


def test_digits_split_meta_and_predict_encoding(tmp_path):
    cfg = load_config(None, ["model.name=resnet18", "data.name=digits", "data.image_size=32"])
    bundle = build_data(cfg, None)
    assert (len(bundle.train), len(bundle.val), len(bundle.test)) == (1437, 180, 180)
    assert not set(bundle.train.indices) & set(bundle.test.indices)
    x, y = bundle.val[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and 0 <= y < 10  # grey repeated to RGB
    assert bundle.meta["input"] == "image" and bundle.meta["label_names"] == [str(i) for i in range(10)]
    assert bundle.meta["source_channels"] == 1 and len(bundle.meta["mean"]) == 3
    # A PNG of the same 8-bit digit goes through exactly the validation transform.
    from sklearn.datasets import load_digits

    raw = np.rint(load_digits().images[bundle.val.indices[0]] * 255 / 16).astype(np.uint8)
    Image.fromarray(raw, mode="L").save(tmp_path / "digit.png")
    assert torch.equal(encode_images(bundle.meta, [str(tmp_path / "digit.png")])[0], x)


def test_augmentation_changes_training_items_only():
    cfg = load_config(None, ["model.name=cnn", "data.name=digits", "data.augment=true", "data.image_size=16"])
    bundle = build_data(cfg, None)
    torch.manual_seed(0)
    train = torch.stack([bundle.train[i][0] for i in range(64)])
    plain = torch.stack([bundle.val.dataset[i][0] for i in bundle.train.indices[:64]])  # same storage, no augmentation
    assert train.shape == plain.shape == (64, 1, 16, 16) and not torch.equal(train, plain)
    assert torch.equal(bundle.val[0][0], bundle.val[0][0])  # validation is deterministic


def test_fashion_mnist_reads_idx_files(tmp_path):
    images, labels = fashion_mnist_root(tmp_path)
    cfg = load_config(None, ["model.name=cnn", "data.name=fashion_mnist", f"data.root={tmp_path}"])
    bundle = build_data(cfg, None)
    assert (len(bundle.train), len(bundle.val), len(bundle.test)) == (216, 24, 60)
    assert bundle.meta["label_names"][0] == "T-shirt/top"
    i = bundle.train.indices[0]
    x, y = bundle.train[0]
    assert y == labels[i] and x.shape == (1, 28, 28)
    expected = (torch.from_numpy(images[i]).float() / 255 - bundle.meta["mean"][0]) / bundle.meta["std"][0]
    assert torch.allclose(x[0], expected, atol=1e-5)


def test_fashion_mnist_trains_under_ddp_with_workers(tmp_path):
    fashion_mnist_root(tmp_path / "data", n_train=400, n_test=100)
    proc = torchrun(2, "train", "model.name=cnn", "data.name=fashion_mnist", "data.root=data", "data.num_workers=1",
                    "training.epochs=2", "training.batch_size=16", "experiment.name=fm", *QUIET, cwd=tmp_path)
    assert_ok(proc)
    summary = json.loads((tmp_path / "experiments/fm/metrics.json").read_text())
    assert summary["dataset"] == {"name": "fashion_mnist", "task": "classification", "train": 360, "val": 40,
                                  "test": 100, "num_classes": 10, "vocab_size": None}
    assert summary["ddp"]["world_size"] == 2 and summary["ddp"]["ranks_identical"]
    assert summary["epochs"][-1]["val_accuracy"] > 0.5  # the band position is easy to learn
    assert summary["test"]["samples"] == 100 and summary["test"]["accuracy"] > 0.5
    assert {"top5_accuracy", "precision", "recall", "f1"} <= summary["test"].keys()


def test_image_folder_layouts(tmp_path):
    image_tree(tmp_path / "split")
    cfg = load_config(None, ["model.name=cnn", "data.name=image_folder", f"data.root={tmp_path / 'split'}",
                             "data.image_size=16", "data.test_fraction=0", f"data.cache_dir={tmp_path / 'cache'}"])
    bundle = build_data(cfg, None)
    assert (len(bundle.train), len(bundle.val), bundle.test) == (18, 6, None)
    assert bundle.meta["label_names"] == ["class_0", "class_1", "class_2"] and bundle.val[0][0].shape == (3, 16, 16)

    image_tree(tmp_path / "one", per_class=10, split=False)
    cfg = load_config(None, ["model.name=cnn", "data.name=image_folder", f"data.root={tmp_path / 'one'}",
                             "data.val_fraction=0.2", "data.test_fraction=0.1", f"data.cache_dir={tmp_path / 'cache'}"])
    bundle = build_data(cfg, None)
    assert (len(bundle.train), len(bundle.val), len(bundle.test)) == (21, 6, 3)
    assert bundle.meta["image_size"] == 64  # no native side: the CNN's folder default

    (tmp_path / "split" / "val" / "class_2").rename(tmp_path / "split" / "val" / "other")
    with pytest.raises(UserError, match="same class folders"):
        build_data(load_config(None, ["model.name=cnn", "data.name=image_folder", f"data.root={tmp_path / 'split'}"]), None)


@pytest.mark.parametrize("case, field", [
    ("missing_root", "data.root"),
    ("no_files", "FashionMNIST/raw"),
    ("one_class", "1 class folder"),
])
def test_bad_data_is_one_line_exit_2(case, field, tmp_path, capsys, monkeypatch):
    from ddplab.cli import main

    args = {
        "missing_root": ["data.name=image_folder", f"data.root={tmp_path / 'nowhere'}"],
        "no_files": ["data.name=fashion_mnist", f"data.root={tmp_path}"],
        "one_class": ["data.name=image_folder", f"data.root={tmp_path / 'tree'}"],
    }[case]
    if case == "one_class":
        image_tree(tmp_path / "tree", classes=1, per_class=2, split=False)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "model.name=cnn", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddplab: error: ") and field in lines[0], lines
    assert not (tmp_path / "experiments").exists()



def test_batched_fetch_and_collate_give_what_item_by_item_loading_gives():
    import torch
    from torch.utils.data import DataLoader, Subset
    from torch.utils.data._utils.collate import default_collate

    from ddplab.data.vision import ImageTensors, stack_images

    images, labels = torch.randint(0, 255, (40, 1, 8, 8), dtype=torch.uint8), (torch.arange(40) % 10).int()
    data = Subset(ImageTensors(images, labels), list(range(3, 40, 2)))
    batches = list(DataLoader(data, batch_size=8, collate_fn=stack_images))  # through __getitems__
    items = [data[i] for i in range(len(data))]  # one __getitem__ each
    expected = [default_collate(items[s:s + 8]) for s in range(0, len(items), 8)]
    assert len(batches) == len(expected) == 3
    for (x, y), (xe, ye) in zip(batches, expected):
        assert torch.equal(x, xe) and torch.equal(y, ye) and y.dtype == torch.int64
