"""Image data through the image workload file: digits, torchvision's FashionMNIST reading real
IDX files, ImageFolder trees at their own size and mode, the validation transform that
`predict` reuses (`Data.preprocess`), and bad input caught before launch."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import assert_ok, ddplab
from ddplab.errors import UserError
from ddplab.registry import load_config
from ddplab.workload import BuildConfig, Options
from ddplab.workloads import images

QUIET = ["logging.trackers=[]", "logging.progress=false"]


def build_data(cfg):
    """The image workload's data function, given the config as any workload is (outside a job)."""
    return images.data(BuildConfig(Options(), cfg))


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
            images[i, 2 * k + 4 : 2 * k + 8] = 230
        write_idx(root / "FashionMNIST" / "raw" / f"{split}-images-idx3-ubyte", images)
        write_idx(root / "FashionMNIST" / "raw" / f"{split}-labels-idx1-ubyte", labels)
        out.append((images, labels))
    return out[0]


def image_tree(
    root: Path, classes: int = 3, per_class: int = 6, side: int | tuple = 32, split: bool = True, grey: bool = False
) -> Path:
    """Tiny PNGs, one colour (or grey level) per class under noise: train/ + val/, or one tree.
    `side`: one size, (width, height), or a list of sizes the images take in turn."""
    rng = np.random.default_rng(1)
    colours = [(220, 40, 40), (40, 200, 40), (40, 40, 220), (200, 200, 40)]
    sizes = side if isinstance(side, list) else [side]
    splits = {"train": per_class, "val": 2} if split else {".": per_class}
    k = 0
    for name, n in splits.items():
        for c in range(classes):
            folder = root / name / f"class_{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                size, k = sizes[k % len(sizes)], k + 1
                w, h = (size, size) if isinstance(size, int) else size
                colour = np.array([60 * c + 40] if grey else colours[c])
                pixels = np.clip(colour[None, None] + rng.normal(0, 25, (h, w, len(colour))), 0, 255).astype(np.uint8)
                Image.fromarray(pixels[..., 0] if grey else pixels).save(folder / f"{i}.png")
    return root


def test_digits_split_meta_and_predict_encoding(tmp_path):
    cfg = load_config(None, ["model.name=resnet18", "data.name=digits", "data.image_size=32"])
    data = build_data(cfg)
    assert (len(data.train), len(data.val), len(data.test)) == (1437, 180, 180)
    assert not set(data.train.indices) & set(data.test.indices)
    x, y = data.val[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and 0 <= y < 10  # grey repeated to RGB
    assert data.input_shape == (3, 32, 32) and data.task.num_classes == 10
    assert data.meta["input"] == "image" and data.meta["label_names"] == [str(i) for i in range(10)]
    assert data.meta["source_channels"] == 1 and len(data.meta["mean"]) == 3
    # A PNG of the same 8-bit digit goes through exactly the validation transform.
    from sklearn.datasets import load_digits

    raw = np.rint(load_digits().images[data.val.indices[0]] * 255 / 16).astype(np.uint8)
    Image.fromarray(raw, mode="L").save(tmp_path / "digit.png")
    assert torch.equal(data.preprocess(str(tmp_path / "digit.png")), x)
    with pytest.raises(UserError, match="cannot read image"):
        data.preprocess(str(tmp_path / "missing.png"))


def test_augmentation_changes_training_items_only():
    cfg = load_config(None, ["model.name=cnn", "data.name=digits", "data.augment=true", "data.image_size=16"])
    data = build_data(cfg)
    torch.manual_seed(0)
    train = torch.stack([data.train[i][0] for i in range(64)])
    plain = torch.stack([data.val.dataset[i][0] for i in data.train.indices[:64]])  # same storage, no augmentation
    assert train.shape == plain.shape == (64, 1, 16, 16) and not torch.equal(train, plain)
    assert torch.equal(data.val[0][0], data.val[0][0])  # validation is deterministic


def test_fashion_mnist_reads_idx_files(tmp_path):
    images_, labels = fashion_mnist_root(tmp_path)
    cfg = load_config(None, ["model.name=cnn", "data.name=fashion_mnist", f"data.root={tmp_path}"])
    data = build_data(cfg)
    assert (len(data.train), len(data.val), len(data.test)) == (216, 24, 60)
    assert data.meta["label_names"][0] == "T-shirt/top" and data.task.class_names[0] == "T-shirt/top"
    i = data.train.indices[0]
    x, y = data.train[0]
    assert y == labels[i] and x.shape == (1, 28, 28)
    expected = (torch.from_numpy(images_[i]).float() / 255 - data.meta["mean"][0]) / data.meta["std"][0]
    assert torch.allclose(x[0], expected, atol=1e-5)


def test_fashion_mnist_trains_under_ddp_with_workers(tmp_path):
    fashion_mnist_root(tmp_path / "data", n_train=400, n_test=100)
    proc = ddplab(
        "train",
        "--nproc-per-node",
        "2",
        "model.name=cnn",
        "data.name=fashion_mnist",
        "data.root=data",
        "data.num_workers=1",
        "training.epochs=2",
        "training.batch_size=16",
        "experiment.name=fm",
        *QUIET,
        cwd=tmp_path,
    )
    assert_ok(proc)
    summary = json.loads((tmp_path / "experiments/fm/metrics.json").read_text())
    assert summary["dataset"] == {
        "name": "fashion_mnist",
        "task": "classification",
        "train": 360,
        "val": 40,
        "test": 100,
        "num_classes": 10,
        "vocab_size": None,
    }
    assert summary["ddp"]["world_size"] == 2 and summary["ddp"]["ranks_identical"]
    assert summary["epochs"][-1]["val_accuracy"] > 0.5  # the band position is easy to learn
    assert summary["test"]["samples"] == 100 and summary["test"]["accuracy"] > 0.5
    assert {"top5_accuracy", "precision", "recall", "f1"} <= summary["test"].keys()


def folder_config(tmp_path, tree, *extra):
    return load_config(
        None, ["data.name=image_folder", f"data.root={tmp_path / tree}", f"data.cache_dir={tmp_path / 'cache'}", *extra]
    )


def test_image_folder_layouts(tmp_path):
    image_tree(tmp_path / "split")
    data = build_data(folder_config(tmp_path, "split", "model.name=cnn", "data.image_size=16", "data.test_fraction=0"))
    assert (len(data.train), len(data.val), data.test) == (18, 6, None)
    assert data.meta["label_names"] == ["class_0", "class_1", "class_2"] and data.val[0][0].shape == (3, 16, 16)

    image_tree(tmp_path / "one", per_class=10, split=False)
    data = build_data(
        folder_config(tmp_path, "one", "model.name=cnn", "data.val_fraction=0.2", "data.test_fraction=0.1")
    )
    assert (len(data.train), len(data.val), len(data.test)) == (21, 6, 3)
    assert data.meta["image_size"] == 32  # the images' own size

    (tmp_path / "split" / "val" / "class_2").rename(tmp_path / "split" / "val" / "other")
    with pytest.raises(UserError, match="same class folders"):
        build_data(folder_config(tmp_path, "split", "model.name=cnn"))


@pytest.mark.parametrize("cache", ["raw", "false"])
def test_grey_folder_stays_one_channel_at_its_size_unless_the_model_needs_rgb(tmp_path, cache):
    image_tree(tmp_path / "grey", side=28, grey=True)
    for model in ("cnn", "vit", "resnet18"):
        cfg = folder_config(tmp_path, "grey", f"model.name={model}", f"data.cache={cache}")
        data = build_data(cfg)
        side, channels = (224, 3) if model == "resnet18" else (28, 1)
        x, y = data.val[0]
        assert x.shape == (channels, side, side) and data.input_shape == (channels, side, side), model
        assert data.meta["source_channels"] == 1 and len(data.meta["mean"]) == channels
        if channels == 3:  # grey repeated, not three different readings
            torch.testing.assert_close(
                x[0] * data.meta["std"][0] + data.meta["mean"][0], x[2] * data.meta["std"][2] + data.meta["mean"][2]
            )
        net = images.model(BuildConfig(Options(), cfg), data).eval()
        batch, _ = data.collate_fn([data.val[0], data.val[1]])
        assert net(batch).shape == (2, 3)
        # predict's reading of a file is validation's: val/ is class by class, files in name order
        assert torch.equal(data.preprocess(str(tmp_path / "grey" / "val" / "class_1" / "0.png")), data.val[2][0])


def test_folder_size_from_the_files_or_a_stated_default(tmp_path, capsys):
    image_tree(tmp_path / "wide", side=[(40, 30)], classes=2, per_class=2)
    data = build_data(folder_config(tmp_path, "wide", "model.name=cnn"))
    assert data.meta["image_size"] == 30 and data.val[0][0].shape == (3, 30, 30)
    assert "every image is 40x30: resized to 30 on the shorter side" in capsys.readouterr().err

    image_tree(tmp_path / "mixed", side=[28, 32, (20, 24)], classes=2, per_class=3, grey=True)
    data = build_data(folder_config(tmp_path, "mixed", "model.name=cnn"))
    assert data.meta["image_size"] == 64 and data.val[0][0].shape == (1, 64, 64)
    err = capsys.readouterr().err
    assert "images differ in size (28x28, 32x32, 20x24" in err and "64x64" in err and "data.image_size" in err

    data = build_data(folder_config(tmp_path, "mixed", "model.name=cnn", "data.image_size=20"))
    assert data.val[0][0].shape == (1, 20, 20) and capsys.readouterr().err == ""  # given, not chosen


@pytest.mark.parametrize(
    "case, field",
    [
        ("missing_root", "data.root"),
        ("no_files", "FashionMNIST/raw"),
        ("one_class", "1 class folder"),
    ],
)
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

    from ddplab.workloads.images import ImageTensors, stack_images

    pixels, labels = torch.randint(0, 255, (40, 1, 8, 8), dtype=torch.uint8), (torch.arange(40) % 10).int()
    data = Subset(ImageTensors(pixels, labels), list(range(3, 40, 2)))
    batches = list(DataLoader(data, batch_size=8, collate_fn=stack_images))  # through __getitems__
    items = [data[i] for i in range(len(data))]  # one __getitem__ each
    expected = [default_collate(items[s : s + 8]) for s in range(0, len(items), 8)]
    assert len(batches) == len(expected) == 3
    for (x, y), (xe, ye) in zip(batches, expected, strict=True):
        assert torch.equal(x, xe) and torch.equal(y, ye) and y.dtype == torch.int64
