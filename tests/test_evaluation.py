import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score, f1_score, precision_score, recall_score

from ddplab.metrics.evaluation import ClassificationEvaluator, scores_from_confusion


class OneProcess:
    def all_reduce(self, t, op="sum"):
        return t


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scores_equal_scikit_learn(seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 5, 97)
    p = np.where(rng.random(97) < 0.6, y, rng.integers(0, 5, 97))
    p[p == 4] = 3  # a class never predicted: zero_division behaviour matters
    ev = ClassificationEvaluator(5, torch.device("cpu"))
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
