"""Data as users bring it: a Hugging Face Dataset with a collator and a model that computes its own
loss; torch and Hugging Face streams split across ranks, with uneven shards and exact resume after a
SIGKILL (tests/hf_workloads.py holds the workloads)."""

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import assert_ok, ddplab, torchrun
from ddplab.cli import main

HERE = Path(__file__).resolve().parent
WORK = HERE / "hf_workloads.py"
COMMON = ["logging.trackers=[]", "logging.progress=false", "training.warmup_steps=0", "distributed.timeout=60"]


def _metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


def test_hf_dataset_with_collator_and_the_models_own_loss_on_2_processes(tmp_path, monkeypatch, capfd):
    proc = ddplab(
        "train",
        "--nproc-per-node",
        "2",
        f"model.name={WORK}:bert",
        f"data.name={WORK}:hf_data",
        "training.epochs=3",
        "training.batch_size=16",
        "training.lr=0.003",
        "experiment.name=bert",
        *COMMON,
        cwd=tmp_path,
    )
    assert_ok(proc)
    m = _metrics(tmp_path / "experiments" / "bert")
    assert m["dataset"]["train"] == 256 and m["dataset"]["val"] == 64
    assert m["aggregates"]["final_val_accuracy"] >= 0.9
    assert m["steps"] and all(r["loss"] > 0 for r in m["steps"])
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    code = main(["predict", "experiments/bert", "good great nice film", "the plot was awful", "--trust-code"])
    predicted = capfd.readouterr().out
    assert code == 0 and predicted.count("positive") == 1 and predicted.count("negative") == 1, predicted
    assert [line.split("\t")[-1] for line in predicted.strip().splitlines()] == [
        "good great nice film",
        "the plot was awful",
    ]


def test_the_models_own_loss_is_what_trains(monkeypatch):
    """A set_format("torch") Dataset through DataCollatorWithPadding: the batch is the model's keywords,
    labels included, and the built-in Classification task trains on the loss the model returns."""
    import hf_workloads

    from ddplab.engine.loop.setup import check_output
    from ddplab.workload import BuildConfig, Options

    data = hf_workloads.hf_data(BuildConfig(Options(torch_format=True), config=None))
    model = hf_workloads.bert(None, data)
    check_output(model, data)  # collate, unpack, one forward pass, the task's loss
    batch = data.collate_fn([data.train[i] for i in range(4)])
    inputs, target, n = data.task.unpack(batch)
    assert n == 4 and "labels" in inputs and torch.equal(target, batch["labels"])
    output = model(**inputs)
    assert data.task.loss(output, target) is output.loss


def _run_here(argv: list[str], monkeypatch, where: Path) -> int:
    monkeypatch.chdir(where)
    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


@pytest.mark.parametrize(
    "options, phrase",
    [
        (["data.name=W:bad_data", "data.options.kind=list"], "Data.train is a list; ddplab takes"),
        (["data.name=W:bad_data", "data.options.kind=dataset_dict"], "one split of it"),
        (["data.name=W:bad_data", "data.options.kind=text_left"], "remove them"),
        (["data.name=W:stream_data"], "set training.max_steps"),
    ],
    ids=["list", "dataset_dict", "text_left", "stream_without_max_steps"],
)
def test_other_data_is_refused_in_one_line_before_a_run_folder(options, phrase, tmp_path, monkeypatch, capfd):
    options = [o.replace("W:", f"{WORK}:") for o in options]
    code = _run_here(
        [
            "train",
            f"model.name={WORK}:bert" if "bad" in options[0] else f"model.name={WORK}:recorder",
            *options,
            *COMMON,
        ],
        monkeypatch,
        tmp_path,
    )
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and phrase in err[0], err
    assert not (tmp_path / "experiments").exists()


def test_uneven_shards_end_each_epoch_together(tmp_path):
    """Rank 0's shard holds 10 items, rank 1's 17: with batches of 4, each epoch is 3 steps on both."""
    proc = ddplab(
        "train",
        "--nproc-per-node",
        "2",
        f"model.name={WORK}:recorder",
        f"data.name={WORK}:stream_data",
        "data.options.kind=uneven",
        "training.epochs=3",
        "training.max_steps=100",
        "training.batch_size=4",
        "experiment.name=uneven",
        *COMMON,
        cwd=tmp_path,
        timeout=240,
    )
    assert_ok(proc)
    m = _metrics(tmp_path / "experiments" / "uneven")
    assert m["aggregates"]["steps"] == 9 and m["aggregates"]["epochs_completed"] == 3
    assert m["dataset"]["train"] is None
    assert m["epochs"][-1]["val_accuracy"] is not None


def _records(log: Path, keep: Path) -> dict[int, list[list[int]]]:
    """rank -> the idx of each training forward pass, in order, from one process per rank (the files
    are moved from `log` to `keep`)."""
    keep.mkdir()
    out = {}
    for f in sorted(log.iterdir()):
        rank = int(f.name.split(".")[0])
        assert rank not in out, f"two processes of rank {rank} wrote to {log}"
        out[rank] = [[int(i) for i in line.split()] for line in f.read_text().splitlines()]
        f.rename(keep / f.name)
    return out


def _stream_args(name: str, log: Path, kind: str, workers: int = 0) -> list[str]:
    log.mkdir(exist_ok=True)
    return [
        "train",
        f"model.name={WORK}:recorder",
        f"data.name={WORK}:stream_data",
        f"data.options.kind={kind}",
        f"model.options.log={log}",
        "training.epochs=2",
        "training.max_steps=1000",
        "training.batch_size=4",
        "checkpoint.every=5",
        "logging.log_every=1",
        f"data.num_workers={workers}",
        f"experiment.name={name}",
        *COMMON,
    ]


def _stream_run(cwd: Path, name: str, log: Path, kind: str, workers: int = 0):
    """The job on 2 processes, `ddplab train --nproc-per-node 2`."""
    args = _stream_args(name, log, kind, workers)
    return ddplab(args[0], "--nproc-per-node", "2", *args[1:], cwd=cwd, timeout=240)


@pytest.mark.parametrize("kind", ["torch", "hf"])
def test_a_stream_killed_mid_epoch_resumes_at_the_exact_next_sample(tmp_path, kind, monkeypatch):
    """96 items, 2 ranks x batches of 4: 12 steps an epoch. Rank 0 is SIGKILLed at the start of step 18
    (the snapshot of step 15 is 3 steps into epoch 2); the same command resumes it on 2 processes, a copy
    of it on 1. torch: a stream without state, skipped forward; hf: its own state_dict(). The 2-process
    resume reads with 2 loader workers a rank (the uninterrupted run with none): the order is the same."""
    log, every = tmp_path / "log", Counter(list(range(96)) * 2)
    assert_ok(_stream_run(tmp_path, "whole", log, kind))
    whole = _records(log, tmp_path / "whole")
    assert Counter(i for batch in whole[0] + whole[1] for i in batch) == every

    monkeypatch.setenv("DIE_AT", "17")
    assert _stream_run(tmp_path, "cut", log, kind).returncode != 0
    monkeypatch.delenv("DIE_AT")
    before = {r: steps[:15] for r, steps in _records(log, tmp_path / "cut").items()}  # up to the snapshot
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "experiments" / "cut", elsewhere / "experiments" / "cut")

    resumed = _stream_run(tmp_path, "cut", log, kind, workers=2)
    assert_ok(resumed)
    said = "skipping forward past the first 24 samples" if kind == "torch" else "resumes from its own state_dict()"
    assert said in resumed.stdout, resumed.stdout[-2000:]
    again = _records(log, tmp_path / "again")
    assert {r: before[r] + again[r] for r in (0, 1)} == whole  # the same samples in the same order on each rank

    # the same run resumed on 1 process: this one (a process adds nothing)
    assert _run_here(_stream_args("cut", log, kind), monkeypatch, elsewhere) == 0
    seen = before[0] + before[1] + _records(log, tmp_path / "one")[0]
    assert Counter(i for batch in seen for i in batch) == every


def test_data_that_differs_between_ranks_is_refused_before_training(tmp_path):
    proc = torchrun(
        2,
        "train",
        f"model.name={WORK}:bag",
        f"data.name={WORK}:per_rank_vocabulary",
        "training.max_steps=2",
        "experiment.name=vocab",
        *COMMON,
        cwd=tmp_path,
        timeout=240,
    )
    assert proc.returncode != 0
    assert "returns different data on rank 1 than on rank 0" in proc.stderr + proc.stdout
    assert not (tmp_path / "experiments" / "vocab" / "metrics.json").exists()


def test_a_causal_lm_with_the_lm_collator_is_scored_on_its_shifted_labels():
    """DataCollatorForLanguageModeling(mlm=False) makes labels = input_ids (padding -100); a Hugging Face
    causal LM shifts them itself. LanguageModeling(shift=True) scores the same tokens: its validation
    loss equals the model's own."""
    import datasets
    import hf_workloads
    from transformers import (
        DataCollatorForLanguageModeling,
        GPT2Config,
        GPT2LMHeadModel,
    )

    from ddplab import LanguageModeling
    from ddplab.engine.loop.setup import check_output
    from ddplab.workload import Data

    tok = hf_workloads.tokenizer()
    texts, _ = hf_workloads.reviews(8, 0)
    ds = datasets.Dataset.from_dict({"text": texts}).map(
        lambda b: tok(b["text"]), batched=True, remove_columns=["text"]
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=1, n_head=2, n_positions=32)).eval()
    task = LanguageModeling(len(tok), shift=True)
    data = Data(train=ds, task=task, collate_fn=DataCollatorForLanguageModeling(tok, mlm=False))
    check_output(model, data)
    inputs, target, n = task.unpack(data.collate_fn([ds[i] for i in range(8)]))
    assert n == 8 and (target == -100).any()  # texts of different lengths: padding is not scored
    with torch.no_grad():
        output = model(**inputs)
    evaluator = task.evaluator(torch.device("cpu"))
    evaluator.update(output, target)

    class One:
        def all_reduce(self, t, op="sum"):
            return t

    assert evaluator.compute(One())["loss"] == pytest.approx(output.loss.item(), rel=1e-5)
    assert task.loss(output, target) is output.loss
