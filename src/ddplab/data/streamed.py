"""The built-in text, text_files and image_folder data streamed from shards (data.stream=true): each split a
`ddplab.Shards` whose items are tokenised or decoded in the loader workers, nothing held whole or cached.

What the whole-data path learns from every sample comes without a pass over the data: a text classifier's labels
from the first PREFIX rows of the training shards in file order, a language model's vocabulary from bytes, an
image set's classes from data.num_classes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

from ddplab.data.shards import Shards
from ddplab.errors import UserError

PREFIX = 10_000  # rows of the training shards a text classifier's labels are learned from


def split_shards(cfg, transform: Callable | None = None) -> tuple[Shards, Shards | None, Shards | None]:
    """(train, val, test): training in the order of (experiment.seed, epoch), the others in file order; each
    item through `transform` (a split's own may replace it)."""
    d = cfg.data

    def shards(path: str | None, train: bool) -> Shards | None:
        return None if path is None else Shards(path, seed=cfg.experiment.seed, shuffle=train, transform=transform)

    train = shards(d.train, True)
    assert train is not None  # checks.check_stream: data.stream needs data.train
    return train, shards(d.val, False), shards(d.test, False)


def first_items(shards: Shards, n: int, columns: Sequence[str] | None = None) -> list:
    """The first `n` items of `shards` in file order, as read (no transform)."""
    plain = copy.copy(shards)
    plain.shuffle, plain.transform, plain.columns = False, None, list(columns) if columns is not None else None
    return list(plain.share(0, 0, n, 0, 1, 1, 0, 1))


def check_columns(shards: Shards, path: str, fields: dict[str, str]) -> None:
    """Table shards hold, in their first row, the columns the config names ({"text_column": "text", ...})."""
    row = next(iter(first_items(shards, 1)), None)
    if isinstance(row, dict):
        for field, column in fields.items():
            if column not in row:
                raise UserError(
                    f"data.{field}: {path} has no column '{column}'; its columns: {', '.join(map(str, row))}"
                )
