"""The image cache at scale: built by a pool of processes with the pixels of one, data.cache=jpeg
(small on disk, trains and resumes exactly), a raw cache refused when the disk is too small, and
data.decode=gpu (refused without CUDA; on a GPU, decoded there)."""

import json
import os
import subprocess
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_image_cache import all_items
from test_vision_data import QUIET, build_data
from torchvision.datasets import ImageFolder

from conftest import _env, assert_ok, ddplab, main
from ddplab.data import image_cache
from ddplab.data.image_cache import CachedImages, EncodedImages
from ddplab.errors import UserError
from ddplab.registry import load_config
from faults import command

META = {"image_size": 24, "source_channels": 3, "channels": 3, "mean": [0.5] * 3, "std": [0.25] * 3}


def photo_tree(root: Path, classes: int = 2, per_class: int = 12, side: int = 40) -> Path:
    """JPEGs that compress as photographs do: smooth colour gradients, one hue per class, a little noise."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:side, 0:side] / side
    for split, n in (("train", per_class), ("val", 4)):
        for c in range(classes):
            folder = root / split / f"class_{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                a, b = rng.uniform(0.2, 1, 2)
                planes = [a * xx, b * yy, (xx + yy) / 2] if c % 2 else [b * yy, (xx * yy), a * xx]
                pixels = np.stack(planes, -1) * 220 + rng.normal(0, 2, (side, side, 3))
                Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(folder / f"{i}.jpg", quality=95)
    return root


def _config(tmp_path, *extra):
    return load_config(
        None,
        [
            "model.name=cnn",
            "data.name=image_folder",
            f"data.root={tmp_path / 'tree'}",
            "data.image_size=24",
            f"data.cache_dir={tmp_path / 'cache'}",
            *extra,
        ],
    )


@pytest.mark.parametrize("kind", ["raw", "jpeg"])
def test_a_pool_of_processes_writes_the_bytes_one_process_writes(tmp_path, kind):
    photo_tree(tmp_path / "tree", per_class=20)
    samples = ImageFolder(str(tmp_path / "tree" / "train")).samples
    files = {}
    for workers in (1, 2):
        folder = tmp_path / f"w{workers}"
        image_cache.write(folder, samples, META, kind, workers=workers, log=lambda line: None)
        files[workers] = {p.name: p.read_bytes() for p in folder.iterdir() if p.name != "meta.json"}
    assert files[1] == files[2] and len(files[1]["images.npy" if kind == "raw" else "images.bin"]) > 0
    if kind == "raw":  # each row is its image through the decode steps, wherever the worker wrote it
        steps = image_cache.decode_steps(META)
        expected = np.stack([steps(Image.open(path).convert("RGB")).numpy() for path, _ in samples])
        assert np.array_equal(np.load(tmp_path / "w2" / "images.npy"), expected)


_decode = image_cache.decode_chunk


def _dies_on_a_later_chunk(chunk, meta, rows=None):
    """The first chunk written, then the worker killed as the second starts."""
    if chunk[0] > 0:
        os._exit(9)
    return _decode(chunk, meta, rows)


def test_a_worker_killed_mid_build_leaves_no_cache_and_the_next_build_completes(tmp_path, monkeypatch):
    photo_tree(tmp_path / "tree", per_class=20)
    samples = ImageFolder(str(tmp_path / "tree" / "train")).samples
    folder = tmp_path / "cache" / "images-x"
    monkeypatch.setattr(image_cache, "decode_chunk", _dies_on_a_later_chunk)  # the forked workers inherit it
    with pytest.raises(BrokenProcessPool):
        image_cache.write(folder, samples, META, "raw", workers=2, log=lambda line: None)
    assert not (tmp_path / "cache").exists()  # no folder, no temporary one, not even the parent made for it
    monkeypatch.setattr(image_cache, "decode_chunk", _decode)
    image_cache.write(folder, samples, META, "raw", workers=2, log=lambda line: None)
    assert len(CachedImages(folder, {**META, "channels": 3}).pixels(np.arange(len(samples)))) == len(samples)


def test_jpeg_cache_is_a_third_of_raw_or_less_and_close_to_it(tmp_path):
    photo_tree(tmp_path / "tree", side=80)  # at 24 pixels a side JPEG's fixed headers would weigh as much as its data
    raw, jpeg = (build_data(_config(tmp_path, "data.image_size=64", f"data.cache={kind}")) for kind in ("raw", "jpeg"))
    assert (raw.train.dataset.format, jpeg.train.dataset.format) == ("raw", "jpeg")
    meta = json.loads((jpeg.train.dataset.folder / "meta.json").read_text())
    assert meta["quality"] == image_cache.QUALITY and meta["bytes"] <= 0.35 * meta["raw_bytes"]
    assert (jpeg.train.dataset.folder / "images.bin").stat().st_size == meta["bytes"]
    x_raw, y_raw = all_items(raw, "train")
    x_jpeg, y_jpeg = all_items(jpeg, "train")
    assert torch.equal(y_raw, y_jpeg) and x_jpeg.shape == x_raw.shape
    assert (x_jpeg - x_raw).abs().mean() * 0.25 < 2 / 255  # under 2 grey levels apart on average


def test_the_cache_is_named_by_its_words_only():
    assert load_config({"data": {"cache": False}}).data.cache == "false"
    with pytest.raises(UserError, match=r"data.cache.*raw, jpeg, false"):
        load_config({"data": {"cache": True}})


def test_encoded_batches_decode_on_arrival_to_the_pixels_of_the_workers_path(tmp_path):
    """data.decode=gpu's path, run on the CPU: the same batches as decoding in the loader."""
    photo_tree(tmp_path / "tree")
    data = build_data(_config(tmp_path, "data.cache=jpeg"))
    cache = data.train.dataset
    encoded = CachedImages(cache.folder, cache.meta, encoded=True)
    batch = encoded.__getitems__([3, 0, 5])
    assert isinstance(batch.images, EncodedImages) and len(batch.images) == 3
    expected = cache.__getitems__([3, 0, 5])
    assert torch.equal(batch.images.to(torch.device("cpu")), expected.images)
    assert torch.equal(batch.labels, expected.labels)


def test_a_raw_cache_too_big_for_the_disk_is_one_line_naming_jpeg(tmp_path, monkeypatch, capfd):
    photo_tree(tmp_path / "tree")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(image_cache, "free_space", lambda path: 4096)
    code = main(
        "train",
        "model.name=cnn",
        "data.name=image_folder",
        f"data.root={tmp_path / 'tree'}",
        "data.image_size=24",
        "training.max_steps=1",
        *QUIET,
    )
    err = capfd.readouterr().err
    assert code == 2, err[-2000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "data.cache=jpeg" in lines[0] and "4.0 KiB free" in lines[0]
    assert not list((tmp_path / "experiments").glob("*/checkpoints/*"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_decode_gpu_without_cuda_is_one_line_before_any_process(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    code = main(
        "train",
        "model.name=cnn",
        "data.name=image_folder",
        f"data.root={tmp_path}",
        "data.decode=gpu",
        "data.cache=jpeg",
    )
    err = capfd.readouterr().err
    assert code == 2 and err.strip().count("\n") == 0
    assert "data.decode=gpu needs CUDA" in err and not (tmp_path / "experiments").exists()


def _run(tmp_path, name, *extra, spec=None):
    args = [
        "train",
        "model.name=cnn",
        "data.name=image_folder",
        f"data.root={tmp_path / 'tree'}",
        "data.image_size=24",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.cache=jpeg",
        "data.augment=true",
        "training.batch_size=4",
        "training.epochs=2",
        "checkpoint.every=2",
        "logging.log_every=1",
        "distributed.timeout=60",
        f"experiment.name={name}",
        *QUIET,
        *extra,
    ]
    # Uninterrupted: launched as a user would; with a fault: tests/faults.py under torchrun, restarted once.
    if spec is None:
        proc = ddplab(args[0], "--nproc-per-node", "2", *args[1:], cwd=tmp_path, timeout=240)
    else:
        proc = subprocess.run(
            command(spec, args, 2, 1), cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240
        )
    assert_ok(proc)
    run = tmp_path / "experiments" / name
    return json.loads((run / "metrics.json").read_text()), run


def test_a_jpeg_cache_trains_and_resumes_exactly(tmp_path):
    """2 ranks, 3 steps an epoch: rank 1 killed after step 4 (snapshot at 4) and restarted = never killed."""
    from test_fault_tolerance import _losses, _weights

    photo_tree(tmp_path / "tree")
    ref, ref_run = _run(tmp_path, "ref")
    broken, run = _run(tmp_path, "k", spec="kill_rank=1,step=5")
    assert broken["status"] == "complete" and broken["aggregates"]["resumes"] == 1
    mine, theirs = _weights(run), _weights(ref_run)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert _losses(run) == _losses(ref_run) and len(_losses(run)) == 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (nvJPEG)")
@pytest.mark.parametrize("cache", ["jpeg", "false"])
def test_decode_gpu_trains_from_jpegs_decoded_on_the_device(tmp_path, cache):
    photo_tree(tmp_path / "tree")
    proc = ddplab(
        "train",
        "model.name=cnn",
        "data.name=image_folder",
        f"data.root={tmp_path / 'tree'}",
        "data.image_size=24",
        f"data.cache={cache}",
        "data.decode=gpu",
        "training.max_steps=3",
        "training.batch_size=4",
        "experiment.name=g",
        *QUIET,
        cwd=tmp_path,
        timeout=180,
    )
    assert_ok(proc)
    assert json.loads((tmp_path / "experiments/g/metrics.json").read_text())["status"] == "complete"
    data = build_data(_config(tmp_path, "data.cache=jpeg"))
    batch = CachedImages(data.train.dataset.folder, data.meta, encoded=True).__getitems__([0, 1])
    on_gpu = batch.images.to(torch.device("cuda"))
    assert on_gpu.is_cuda and on_gpu.shape == (2, 3, 24, 24)
    torch.testing.assert_close(on_gpu.cpu(), data.train.dataset.__getitems__([0, 1]).images, atol=0.1, rtol=0)
