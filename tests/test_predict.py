"""`ddplab predict` on any workload: the run's own data function rebuilds its Data, whose
preprocess, dataset transform or numbers turn raw inputs into samples; rows as the task gives them."""

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Subset, TensorDataset

import ddplab
from conftest import ROOT
from ddplab.cli import main
from ddplab.commands.predict import encoder, expand

FAST = ["logging.trackers=[]", "logging.progress=false", "distributed.timeout=60"]

REGRESSION = """
import torch
import ddplab
from torch.utils.data import TensorDataset


def data(cfg):
    x = torch.randn(200, 3, generator=torch.Generator().manual_seed(0))
    y = torch.stack([x.sum(1), x[:, 0] - x[:, 1]], 1)
    return ddplab.Data(train=TensorDataset(x[:160], y[:160]), val=TensorDataset(x[160:], y[160:]),
                       task=ddplab.Regression(outputs=2))


def model(cfg, data):
    return torch.nn.Linear(3, 2)
"""


def _image_tree(root: Path, per_class: int = 12) -> Path:
    """Red and blue squares, with noise: two classes a small CNN tells apart in a few steps."""
    from PIL import Image

    g = np.random.default_rng(0)
    for name, channel in (("blue", 2), ("red", 0)):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = g.integers(0, 90, (12, 12, 3))
            pixels[..., channel] += 160
            Image.fromarray(pixels.astype(np.uint8)).save(root / name / f"{i:02d}.png")
    return root


def _here(folder: Path, *argv: str) -> int:
    """`ddplab ARGV` run in `folder`, in this process."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        return main(list(argv))


@pytest.fixture(scope="module")
def image_run(tmp_path_factory) -> Path:
    place = tmp_path_factory.mktemp("img")
    _image_tree(place / "tree")
    wl = Path(shutil.copy(ROOT / "examples" / "image_folder.py", place))
    code = _here(
        place,
        "train",
        f"model.name={wl}:model",
        f"data.name={wl}:data",
        "data.options.root=tree",
        "data.options.side=12",
        "training.epochs=8",
        "training.batch_size=8",
        "training.lr=3e-3",
        "training.warmup_steps=0",
        "experiment.name=img",
        *FAST,
    )
    assert code == 0 and json.loads((place / "experiments/img/metrics.json").read_text())["status"] == "complete"
    return place


def test_an_image_file_of_an_image_folder_workload_gets_its_label(image_run, capfd):
    code = _here(image_run, "predict", "experiments/img", "tree/red/00.png", "tree/blue/03.png", "--output", "p.jsonl")
    out = capfd.readouterr().out
    assert code == 0, out
    lines = [line.split("\t") for line in out.strip().splitlines()]
    assert [(label, path) for label, _, path in lines] == [("red", "tree/red/00.png"), ("blue", "tree/blue/03.png")]
    assert all(0.5 < float(p) <= 1 for _, p, _ in lines)
    rows = [json.loads(line) for line in (image_run / "p.jsonl").read_text().splitlines()]
    assert [r["input"] for r in rows] == ["tree/red/00.png", "tree/blue/03.png"]
    assert rows[0]["label"] == "red" and rows[0]["probability"] == pytest.approx(float(lines[0][1]), abs=1e-5)


def test_a_folder_with_top_k_2_and_a_csv(image_run, capfd):
    code = _here(
        image_run,
        "predict",
        "experiments/img",
        "tree/blue",
        "--top-k",
        "2",
        "--batch-size",
        "5",
        "--output",
        "p.csv",
    )
    out = capfd.readouterr().out
    assert code == 0, out
    files = sorted(str(p.relative_to(image_run)) for p in (image_run / "tree" / "blue").iterdir())
    rows = list(csv.DictReader(open(image_run / "p.csv")))
    assert [r["input"] for r in rows] == files and len(rows) == 12  # every file, in order, over 3 batches
    assert list(rows[0]) == ["input", "label_1", "probability_1", "label_2", "probability_2"]
    for row in rows:
        assert {row["label_1"], row["label_2"]} == {"red", "blue"}
        assert float(row["probability_1"]) + float(row["probability_2"]) == pytest.approx(1, abs=1e-5)
    assert sum(r["label_1"] == "blue" for r in rows) >= 11
    printed = [line.split("\t") for line in out.strip().splitlines()]
    assert [p[-1] for p in printed] == files and all(len(p) == 5 for p in printed)


@pytest.mark.parametrize(
    "argv, phrase",
    [
        (["--top-k", "3"], "--top-k 3: this classifier has 2 classes"),
        (["--output", "p.txt"], "--output p.txt: name a .csv or a .jsonl file"),
        (["--top-k", "0"], "--top-k must be >= 1"),
    ],
    ids=["top-k-above-classes", "output-kind", "top-k-zero"],
)
def test_bad_predict_options_are_one_line(image_run, argv, phrase, monkeypatch, capfd):
    monkeypatch.chdir(image_run)
    code = main(["predict", "experiments/img", "tree/red/00.png", *argv])
    err = [line for line in capfd.readouterr().err.strip().splitlines() if not line.startswith("ddplab: importing")]
    assert code == 2 and len(err) == 1 and phrase in err[0], err


def test_a_regression_run_predicts_from_numbers_npy_and_pt(tmp_path, monkeypatch, capfd):
    (tmp_path / "reg.py").write_text(REGRESSION)
    monkeypatch.chdir(tmp_path)
    ddplab.train(
        None,
        [
            "model.name=reg.py:model",
            "data.name=reg.py:data",
            "training.epochs=30",
            "training.batch_size=16",
            "training.lr=3e-2",
            "training.warmup_steps=0",
            "experiment.name=reg",
            *FAST,
        ],
    )
    np.save(tmp_path / "x.npy", np.array([1.0, 2.0, -1.0]))
    torch.save(torch.tensor([0.5, -0.5, 0.0]), tmp_path / "x.pt")
    capfd.readouterr()
    assert main(["predict", "experiments/reg", "1,2,-1", "x.npy", "x.pt", "--output", "p.jsonl"]) == 0
    printed = capfd.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [r["input"] for r in rows] == ["1,2,-1", "x.npy", "x.pt"] and set(rows[0]) == {"input", "value_1", "value_2"}
    want = [(2.0, -1.0), (2.0, -1.0), (0.0, 1.0)]  # sum and difference of the first two
    for row, (a, b) in zip(rows, want, strict=True):
        assert row["value_1"] == pytest.approx(a, abs=0.05) and row["value_2"] == pytest.approx(b, abs=0.05)
    assert printed.splitlines()[2].split("\t")[-1] == "x.pt"


DATA_ON_DISK = """
import torch
import ddplab
from torch.utils.data import TensorDataset


def data(cfg):
    x = torch.load(cfg.options.file)
    return ddplab.Data(train=TensorDataset(x, x.sum(1, keepdim=True)), task=ddplab.Regression())


def model(cfg, data):
    return torch.nn.Linear(3, 1)
"""


def test_data_moved_without_assets_is_one_line(tmp_path, monkeypatch, capfd):
    (tmp_path / "disk.py").write_text(DATA_ON_DISK)
    torch.save(torch.randn(32, 3), tmp_path / "x.pt")
    monkeypatch.chdir(tmp_path)
    ddplab.train(
        None,
        ["model.name=disk.py:model", "data.name=disk.py:data", "data.options.file=x.pt"]
        + ["training.epochs=1", "experiment.name=disk", *FAST],
    )
    (tmp_path / "x.pt").rename(tmp_path / "moved.pt")
    capfd.readouterr()
    assert main(["predict", "experiments/disk", "1,2,3"]) == 2
    err = [line for line in capfd.readouterr().err.strip().splitlines() if not line.startswith("ddplab: importing")]
    assert len(err) == 1 and "x.pt" in err[0] and "Data(assets=" in err[0], err


# ---------------------------------------------------------------------------- encoder, in process


def test_preprocess_then_a_dataset_transform_then_numbers(tmp_path):
    from torchvision import datasets, transforms

    numbers = TensorDataset(torch.zeros(4, 3, dtype=torch.float64), torch.zeros(4))
    with_preprocess = ddplab.Data(train=numbers, task=ddplab.Regression(), preprocess=lambda s: torch.ones(len(s)))
    assert torch.equal(encoder(with_preprocess)("abcd"), torch.ones(4))
    as_numbers = encoder(ddplab.Data(train=numbers, task=ddplab.Regression()))("1,2.5,3")
    assert as_numbers.dtype == torch.float64 and as_numbers.tolist() == [1, 2.5, 3]  # the dataset's own dtype

    tree = _image_tree(tmp_path / "tree", per_class=1)
    grey = datasets.ImageFolder(tree, transform=transforms.Compose([transforms.Grayscale(), transforms.ToTensor()]))
    wrapped = ddplab.Data(train=Subset(grey, [0]), val=Subset(Subset(grey, [0, 1]), [1]), task=ddplab.Classification(2))
    image = encoder(wrapped)(str(tree / "red" / "00.png"))
    assert torch.equal(image, grey[1][0])  # opened by the dataset's loader, under its transform


def test_a_folder_stands_for_its_files_sorted(tmp_path):
    for name in ("b.txt", "a.txt", ".hidden"):
        (tmp_path / "in" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "in" / name).write_text("1")
    assert expand(["0,1", str(tmp_path / "in")]) == [
        "0,1",
        str(tmp_path / "in" / "a.txt"),
        str(tmp_path / "in" / "b.txt"),
    ]
