"""Workloads for tests/test_shards.py and tests/test_streams.py: ddplab.Shards over Parquet shards of rows
{idx} in data.options.path; streams that split themselves by rank and loader worker as users write them
(WebDataset-style tar shards of images, Parquet row groups); and a linear model that writes the idx of every
training sample it sees."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

import ddplab


def features(row: dict) -> dict:
    """A sample made from its idx alone: 4 numbers, their sign as the label."""
    x = torch.randn(4, generator=torch.Generator().manual_seed(row["idx"]))
    return {"x": x, "labels": int(x.sum() > 0), "idx": row["idx"]}


def shards_data(cfg):
    train = ddplab.Shards(cfg.options.path, seed=cfg.config.experiment.seed, window=8, transform=features)
    val = ddplab.Shards(cfg.options.path, shuffle=False, transform=features)
    return ddplab.Data(train=train, val=val, task=ddplab.Classification(2))


def _place() -> tuple[int, int, int, int]:
    """(rank, world size, loader worker, workers), as a stream that splits itself reads them."""
    dist = torch.distributed
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    info = get_worker_info()
    return rank, world, *((info.id, info.num_workers) if info is not None else (0, 1))


class TarImages(IterableDataset):
    """WebDataset's habit by hand: the tar shards of a folder split by node (rank), then by loader worker;
    each sample a 2x2 grey PNG (<key>.png) and its class (<key>.cls)."""

    def __init__(self, folder) -> None:
        self.shards = sorted(str(p) for p in Path(folder).glob("*.tar"))

    def __iter__(self):
        from PIL import Image

        rank, world, worker, workers = _place()
        for shard in self.shards[rank::world][worker::workers]:
            with tarfile.open(shard) as tar:
                files = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}
            for key in sorted({name.split(".")[0] for name in files}):
                pixels = np.asarray(Image.open(io.BytesIO(files[f"{key}.png"])), dtype=np.float32) / 255
                yield {"x": torch.from_numpy(pixels)[None], "labels": int(files[f"{key}.cls"]), "idx": int(key)}


class TarImagesWithLength(TarImages):
    """The same with a __len__ that may be wrong, as webdataset's .with_length(n) often is."""

    def __init__(self, folder, length: int) -> None:
        super().__init__(folder)
        self.length = length

    def __len__(self) -> int:
        return self.length


def write_tar_images(folder: Path, shards: int = 8, per_shard: int = 12, gone: int | None = None) -> Path:
    """`shards` tar shards of `per_shard` samples each, idx 0, 1, ... in order."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for k in range(shards):
        with tarfile.open(folder / f"{k:03}.tar", "w") as tar:
            for idx in range(k * per_shard, (k + 1) * per_shard):
                x = features({"idx": idx})["x"]
                image, png = (
                    Image.fromarray(((x.reshape(2, 2).tanh() + 1) * 127).numpy().astype(np.uint8)),
                    io.BytesIO(),
                )
                image.save(png, format="PNG")
                for ext, data in (("png", png.getvalue()), ("cls", str(int(x.sum() > 0)).encode())):
                    info = tarfile.TarInfo(f"{idx:05}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return folder


class ParquetGroups(IterableDataset):
    """A Parquet file's row groups dealt to each (rank, loader worker) in turn: group g to reader g mod
    (world size x workers), reader rank x workers + worker."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __iter__(self):
        import pyarrow.parquet as pq

        rank, world, worker, workers = _place()
        pf = pq.ParquetFile(self.path)
        for group in range(rank * workers + worker, pf.num_row_groups, world * workers):
            for idx in pf.read_row_group(group, columns=["idx"]).column("idx").to_pylist():
                yield features({"idx": idx})


def streams_data(cfg):
    """options.kind: tar (options.path: a folder of tar shards; options.length: its __len__) or parquet
    (options.path: a Parquet file); the validation split is the same stream."""
    o = cfg.options
    if o.kind == "tar":
        train = TarImagesWithLength(o.path, o.length) if o.get("length") else TarImages(o.path)
        val = TarImages(o.path)
    else:
        train, val = ParquetGroups(o.path), ParquetGroups(o.path)
    return ddplab.Data(train=train, val=val, task=ddplab.Classification(2))


class Recorder(torch.nn.Module):
    """Appends the idx of each training batch, one line a forward pass, to
    <options.log>/<rank>.<torchrun restart>.<pid>."""

    def __init__(self, log: str) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.log = Path(log)

    def forward(self, x, labels=None, idx=None):
        if self.training and torch.is_grad_enabled():
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            with open(self.log / f"{rank}.{restart}.{os.getpid()}", "a") as f:
                f.write(" ".join(str(int(i)) for i in idx) + "\n")
        return self.linear(x.flatten(1))


def recorder(cfg, data):
    torch.manual_seed(0)
    return Recorder(cfg.options.log)
