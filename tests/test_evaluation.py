import csv

import numpy as np
import pytest
import torch

from ddplab.evaluators import ClassificationEvaluator, scores_from_confusion
from ddplab.tasks import Classification


class OneProcess:
    def all_reduce(self, t, op="sum"):
        return t


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scores_equal_scikit_learn(seed):
    from sklearn.metrics import accuracy_score, f1_score, precision_score, recall_score  # seconds: not at collection

    rng = np.random.default_rng(seed)
    y = rng.integers(0, 5, 97)
    p = np.where(rng.random(97) < 0.6, y, rng.integers(0, 5, 97))
    p[p == 4] = 3  # a class never predicted: zero_division behaviour matters
    ev = Classification(5).evaluator(torch.device("cpu"))
    logits = torch.nn.functional.one_hot(torch.tensor(p), 5).float()
    ev.update(logits, torch.tensor(y))
    got = ev.compute(OneProcess())
    assert got["accuracy"] == pytest.approx(accuracy_score(y, p))
    assert got["precision"] == pytest.approx(precision_score(y, p, average="macro", zero_division=0))
    assert got["recall"] == pytest.approx(recall_score(y, p, average="macro", zero_division=0))
    assert got["f1"] == pytest.approx(f1_score(y, p, average="macro", zero_division=0))
    assert got["samples"] == 97


def test_confusion_scores_perfect():
    scores = scores_from_confusion(torch.eye(3, dtype=torch.float64) * 4)
    assert scores == {"accuracy": 1.0, "precision": 1.0, "recall": 1.0, "f1": 1.0}


class TwoRanks:
    """Rank 0's view of a sum all-reduce over two ranks: adds rank 1's matching local tensor."""

    def __init__(self, other: ClassificationEvaluator):
        self.other = other

    def all_reduce(self, t, op="sum"):
        return t + (self.other.confusion if t.shape == self.other.confusion.shape else self.other.sums)


@pytest.mark.parametrize("seed", [0, 3])
def test_global_confusion_matrix_and_per_class_scores_equal_scikit_learn(seed, tmp_path):
    from sklearn.metrics import confusion_matrix, precision_recall_fscore_support

    from ddplab.evaluators import per_class_scores
    from ddplab.metrics.class_report import class_reports

    rng = np.random.default_rng(seed)
    y = rng.integers(0, 6, 150)
    p = np.where(rng.random(150) < 0.5, y, rng.integers(0, 6, 150))
    p[p == 5] = 0  # class 5 is never predicted
    shards = [(torch.tensor(p[:70]), torch.tensor(y[:70])), (torch.tensor(p[70:]), torch.tensor(y[70:]))]
    evs = []
    for pred, target in shards:  # each rank sees its own shard only
        ev = Classification(6).evaluator(torch.device("cpu"))
        ev.update(torch.nn.functional.one_hot(pred, 6).float(), target)
        evs.append(ev)
    ev = evs[0]
    ev.compute(TwoRanks(evs[1]))
    expected = confusion_matrix(y, p, labels=range(6))
    assert (ev.global_confusion.numpy() == expected).all() and ev.global_confusion.sum() == 150

    precision, recall, f1, support = precision_recall_fscore_support(
        y, p, labels=range(6), average=None, zero_division=0
    )
    got = per_class_scores(ev.global_confusion)
    assert got["precision"] == pytest.approx(list(precision)) and got["recall"] == pytest.approx(list(recall))
    assert got["f1"] == pytest.approx(list(f1)) and got["support"] == list(support)

    names = ["zero", "one", "two", "three", "four", "five"]
    report = class_reports({"val": ev}, tmp_path, names, write=True)
    assert report["val"]["confusion_matrix"] == expected.tolist()
    assert report["val"]["per_class"]["five"] == {
        "precision": 0.0,
        "recall": 0.0,
        "f1": 0.0,
        "support": int(support[5]),
    }
    rows = list(csv.reader(open(tmp_path / "confusion_matrix_val.csv")))
    assert rows[0][1:] == names and [[int(x) for x in r[1:]] for r in rows[1:]] == expected.tolist()
    assert (tmp_path / "confusion_matrix_val.png").read_bytes()[:4] == b"\x89PNG"


def test_plots_off_keeps_the_csv_and_draws_no_png(tmp_path):
    from ddplab.metrics.class_report import class_reports

    class Alone:  # one rank: the all-reduce is the tensor itself
        def all_reduce(self, t, op="sum"):
            return t

    ev = Classification(3).evaluator(torch.device("cpu"))
    ev.update(torch.nn.functional.one_hot(torch.tensor([0, 1, 2, 2]), 3).float(), torch.tensor([0, 1, 1, 2]))
    ev.compute(Alone())
    report = class_reports({"test": ev}, tmp_path, None, write=True, plots=False)
    assert report["test"]["confusion_matrix"] == [[1, 0, 0], [0, 1, 1], [0, 0, 1]]
    assert (tmp_path / "confusion_matrix_test.csv").is_file()
    assert not (tmp_path / "confusion_matrix_test.png").exists()
