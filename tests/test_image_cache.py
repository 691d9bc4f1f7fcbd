"""The image cache: decoded once, the same batches as decoding every epoch, reused, re-keyed
when a file changes, bypassed by data.cache=false, and built once for the ranks of a node."""

import json
import os

import pytest
import torch
from test_vision_data import QUIET, build_data, image_tree
from torch.utils.data import DataLoader

from conftest import assert_ok, ddplab
from ddplab.data.image_cache import CachedImages
from ddplab.errors import UserError
from ddplab.registry import load_config


def config(tmp_path, *extra):
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


def caches(tmp_path):
    return sorted(p.name for p in (tmp_path / "cache").glob("images-*")) if (tmp_path / "cache").is_dir() else []


def all_items(data, split):
    ds = getattr(data, split)
    loader = DataLoader(ds, batch_size=5, shuffle=False, collate_fn=data.collate_fn)
    xs, ys = zip(*loader, strict=True)
    return torch.cat(xs), torch.cat(ys)


def test_cached_batches_equal_decoded_ones_and_cache_is_reused(tmp_path, capsys):
    image_tree(tmp_path / "tree", side=37)  # not the cache's side: resize + crop happen before caching
    plain = build_data(config(tmp_path, "data.cache=false"))
    assert caches(tmp_path) == []  # data.cache=false writes nothing and decodes per item
    assert not isinstance(plain.train.dataset, CachedImages)
    cached = build_data(config(tmp_path))
    assert isinstance(cached.train.dataset, CachedImages)
    out = capsys.readouterr().out  # one line a cache, once it is built: its size and the room there was
    assert out.count("image cache: decoded 18 images to 3x24x24 raw") == 1 and "were free" in out, out
    first = caches(tmp_path)
    assert len(first) == 2  # train/ and val/
    for split in ("train", "val"):
        x0, y0 = all_items(plain, split)
        x1, y1 = all_items(cached, split)
        assert x1.shape == x0.shape == (len(y0), 3, 24, 24) and type(x1) is torch.Tensor
        torch.testing.assert_close(x1, x0)
        assert torch.equal(y1, y0)
    mtimes = [(tmp_path / "cache" / f / "images.npy").stat().st_mtime_ns for f in first]
    again = build_data(config(tmp_path))
    assert "about" not in capsys.readouterr().out
    assert caches(tmp_path) == first
    assert [(tmp_path / "cache" / f / "images.npy").stat().st_mtime_ns for f in first] == mtimes
    torch.testing.assert_close(all_items(again, "val")[0], all_items(cached, "val")[0])


def test_key_changes_when_a_file_or_the_size_changes(tmp_path):
    image_tree(tmp_path / "tree", side=16)
    build_data(config(tmp_path))
    before = set(caches(tmp_path))
    png = next((tmp_path / "tree" / "val" / "class_0").glob("*.png"))
    st = png.stat()
    os.utime(png, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    build_data(config(tmp_path))
    after = set(caches(tmp_path))
    assert len(after - before) == 1 and before <= after  # val/ re-keyed, train/ reused
    build_data(config(tmp_path, "data.image_size=20"))
    assert len(set(caches(tmp_path)) - after) == 2


def test_augmentation_still_random_per_epoch_on_cached_images(tmp_path):
    image_tree(tmp_path / "tree", side=16)
    data = build_data(config(tmp_path, "data.augment=true", "data.image_size=16"))
    torch.manual_seed(0)
    a = torch.stack([data.train[i][0] for i in range(len(data.train))])
    b = torch.stack([data.train[i][0] for i in range(len(data.train))])
    assert a.shape == (len(data.train), 3, 16, 16)
    assert not torch.equal(a, b)
    x, _ = data.collate_fn(data.train.dataset.__getitems__([0, 1, 2]))
    assert x.shape == (3, 3, 16, 16)


def test_an_unreadable_image_is_one_error_and_leaves_nothing_behind(tmp_path, capsys):
    image_tree(tmp_path / "tree", side=16)
    (tmp_path / "tree" / "train" / "class_1" / "broken.png").write_bytes(b"not a png")
    cfg = config(tmp_path, f"data.cache_dir={tmp_path / 'cache' / 'images'}")
    with pytest.raises(UserError, match="broken.png"):
        build_data(cfg)
    assert "image cache" not in capsys.readouterr().out  # no line about a cache that was never built
    assert not (tmp_path / "cache").exists()  # nor the folders made for it
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "mine").write_text("the user's")
    with pytest.raises(UserError, match="broken.png"):
        build_data(config(tmp_path))
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["mine"]  # what was there stays


def test_two_ranks_share_one_cache_built_once(tmp_path):
    """On 2 processes, rank 0 decodes each split once while rank 1 waits, and both train on it."""
    image_tree(tmp_path / "tree")
    proc = ddplab(
        "train",
        "--nproc-per-node",
        "2",
        "model.name=cnn",
        "data.name=image_folder",
        f"data.root={tmp_path / 'tree'}",
        "data.image_size=24",
        f"data.cache_dir={tmp_path / 'cache'}",
        "training.max_steps=2",
        "training.batch_size=4",
        "experiment.name=ic",
        *QUIET,
        cwd=tmp_path,
        timeout=180,
    )
    assert_ok(proc)
    assert (proc.stdout + proc.stderr).count("image cache: decoded") == 2  # train/ and val/, by one rank
    assert len(caches(tmp_path)) == 2
    assert not [p for p in (tmp_path / "cache").iterdir() if ".tmp-" in p.name]
    summary = json.loads((tmp_path / "experiments/ic/metrics.json").read_text())
    assert summary["status"] == "complete" and summary["ddp"]["ranks_identical"]
