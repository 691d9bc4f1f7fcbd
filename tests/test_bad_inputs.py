"""Every command refuses bad input with exactly one stderr line, exit 2, no traceback, and leaves
existing run folders byte-identical. One tiny finished run (`done`) and an unfinished copy of it
(`open`) are shared by all cases; most cases run the CLI in this process (`ddplab.cli.main`), so
they cost milliseconds, and a few run as real processes where only workers can find the problem."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import TINY_GPT, ddplab, main
from ddplab.engine.run_folder.lock import RunLock
from ddplab.engine.snapshots.read import load_checkpoint


def tree_digest(folder: Path) -> dict[str, str]:
    """Every file under `folder` -> SHA-256 of its bytes (an added or removed file shows too)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def place(tmp_path_factory) -> Path:
    """A folder as a user's: a corpus, a finished run `done`, an unfinished run `open`, bad files."""
    from ddplab.workloads.char_lm import embedded_corpus

    root = tmp_path_factory.mktemp("bad")
    (root / "corpus.txt").write_text(embedded_corpus()[:20_000])
    with pytest.MonkeyPatch.context() as here:  # trained in this process: the cases meet what a process leaves
        here.chdir(root)
        assert main("train", "data.path=corpus.txt", *TINY_GPT, "training.max_steps=3", "experiment.name=done") == 0
    done = root / "experiments" / "done"
    shutil.copytree(done, root / "experiments" / "open")
    summary = json.loads((done / "metrics.json").read_text())
    summary["status"] = "running"  # as a crash leaves it
    (root / "experiments" / "open" / "metrics.json").write_text(json.dumps(summary))

    # An unfinished run whose corpus has become empty since: same config, data now bad.
    later = root / "experiments" / "later"
    shutil.copytree(root / "experiments" / "open", later)
    (later / "config.yaml").write_text(
        (later / "config.yaml").read_text().replace("path: corpus.txt", "path: emptied.txt")
    )
    (root / "emptied.txt").write_text("")
    (root / "empty.txt").write_text("")
    (root / "one.txt").write_text("x")
    (root / "short.txt").write_text("to be or not to be, " * 5)
    (root / "binary.txt").write_bytes(bytes(range(256)) * 20)
    (root / "no_text").mkdir()
    (root / "no_text" / "data.bin").write_bytes(b"\0\1\2")
    (root / "empty_dir").mkdir()
    (root / "a_file").write_text("not a folder\n")
    (root / "bad.yaml").write_text("training: [unclosed\n")
    (root / "list.yaml").write_text("- 1\n- 2\n")
    (root / "ok.yaml").write_text("training:\n  lr: 0.001\n")
    snap = sorted((done / "checkpoints").glob("step-*"))[-1]
    (root / "truncated.pt").write_bytes((snap / "state.pt").read_bytes()[:3000])
    # A classifier checkpoint whose config names a model folder that no longer holds a loadable model.
    (root / "hf_model").mkdir()
    (root / "hf_model" / "config.json").write_text("{not json")
    _, ckpt = load_checkpoint(done / "checkpoints" / "best")
    ckpt["config"]["model"].update(name="hf", pretrained=str(root / "hf_model"))
    ckpt.update(task={"kind": "classification", "num_classes": 2})
    ckpt["meta"] = {"input": "text"}
    torch.save(ckpt, root / "moved_model.pt")
    return root


DONE, OPEN = "experiments/done", "experiments/open"
SNAP = "experiments/done/checkpoints/step-000000003"
TRAIN = ["data.path=corpus.txt", *TINY_GPT, "training.max_steps=3"]  # the config `done` and `open` ran with

# (case id, argv, a phrase the one line must hold)
CASES = [
    # train: config and command line, refused before torch is imported
    ("train-missing-yaml", ["train", "no_such.yaml"], "no_such.yaml"),
    ("train-bad-number", ["train", "training.lr=abc"], "training.lr"),
    ("train-negative", ["train", "training.batch_size=-1"], "training.batch_size"),
    ("train-unknown-model", ["train", "model.name=nope"], "model.name"),
    ("train-missing-corpus", ["train", "data.path=/no/such/corpus.txt"], "data.path"),
    ("train-nproc-0", ["train", "--nproc-per-node", "0"], "--nproc-per-node"),
    ("train-nproc-word", ["train", "--nproc-per-node", "two"], "--nproc-per-node"),
    ("train-restarts", ["train", "--max-restarts", "-1"], "--max-restarts"),
    ("train-unknown-key", ["train", "training.nope=1"], "training.nope"),
    ("train-unknown-section", ["train", "nope.lr=1"], "nope"),
    ("train-choice", ["train", "training.optimizer=lion"], "training.optimizer"),
    ("train-heads", ["train", "model.dim=30", "model.heads=4"], "model.heads"),
    ("train-dropout", ["train", "model.dropout=1.5"], "model.dropout"),
    ("train-val-fraction", ["train", "data.val_fraction=1.5"], "data.val_fraction"),
    ("train-budget", ["train", "training.time_budget=forever"], "training.time_budget"),
    ("train-resume-missing", ["train", "checkpoint.resume=/no/such/step-1"], "checkpoint.resume"),
    ("train-two-configs", ["train", "ok.yaml", "ok.yaml"], "ok.yaml"),
    ("train-bad-yaml", ["train", "bad.yaml"], "bad.yaml"),
    ("train-yaml-list", ["train", "list.yaml"], "list.yaml"),
    ("train-unknown-option", ["train", "--bogus"], "--bogus"),
    ("train-bool", ["train", "logging.progress=maybe"], "logging.progress"),
    ("train-tracker", ["train", "logging.trackers=[tensorboard, neptune]"], "logging.trackers"),
    ("train-tokenizer", ["train", "data.tokenizer=wordpiece"], "data.tokenizer"),
    ("train-temperature", ["train", "generate.temperature=-1"], "generate.temperature"),
    # train: found while building data and model, before the first byte is written
    ("train-empty-corpus", ["train", *TRAIN, "data.path=empty.txt", "experiment.name=new"], "too little text"),
    ("train-one-char", ["train", *TRAIN, "data.path=one.txt", "experiment.name=new"], "one.txt"),
    ("train-no-text-files", ["train", *TRAIN, "data.path=no_text", "experiment.name=new"], "no .txt files"),
    ("train-corpus-emptied-since", ["train", *TRAIN, "data.path=emptied.txt", "experiment.name=later"], "emptied.txt"),
    ("train-binary-corpus", ["train", *TRAIN, "data.path=binary.txt", "experiment.name=new"], "not UTF-8"),
    (
        "train-context-too-long",
        ["train", *TRAIN, "data.path=short.txt", "model.context=512", "experiment.name=x"],
        "model.context=512",
    ),
    ("train-tokenizer-misfit", ["train", *TRAIN, "data.tokenizer=hash", "experiment.name=x"], "data.tokenizer"),
    (
        "train-resume-not-checkpoint",
        ["train", *TRAIN, "checkpoint.resume=corpus.txt", "experiment.name=open"],
        "corpus.txt",
    ),
    (
        "train-resume-truncated",
        ["train", *TRAIN, "checkpoint.resume=truncated.pt", "experiment.name=open"],
        "truncated",
    ),
    (
        "train-resume-other-model",
        ["train", *TRAIN, "model.layers=2", f"checkpoint.resume={SNAP}", "experiment.name=x"],
        "another model",
    ),
    (
        "train-resume-other-width",
        ["train", *TRAIN, "model.dim=64", f"checkpoint.resume={SNAP}", "experiment.name=x"],
        "another model",
    ),
    (
        "train-changed-config",
        ["train", *TRAIN, "training.weight_decay=0.5", "experiment.name=open"],
        "training.weight_decay:",
    ),
    ("train-changed-model", ["train", *TRAIN, "model.dim=64", "experiment.name=open"], "model.dim: 32 -> 64"),
    ("train-changed-data", ["train", *TRAIN, "data.limit=10", "experiment.name=open"], "data.limit"),
    ("train-output-dir-file", ["train", *TRAIN, "experiment.output_dir=a_file"], "a_file"),
    ("train-output-dir-under-file", ["train", *TRAIN, "experiment.output_dir=a_file/runs"], "a_file"),
    # generate
    ("generate-missing", ["generate", "/no/such/run"], "/no/such/run"),
    ("generate-temperature", ["generate", DONE, "--temperature", "-1"], "--temperature"),
    ("generate-top-k", ["generate", DONE, "--top-k", "-3"], "--top-k"),
    ("generate-tokens", ["generate", DONE, "--max-new-tokens", "0"], "--max-new-tokens"),
    ("generate-no-checkpoint", ["generate", "empty_dir"], "empty_dir"),
    ("generate-not-checkpoint", ["generate", "corpus.txt"], "corpus.txt"),
    ("generate-unknown-chars", ["generate", DONE, "--prompt", "\u20ac\u20ac"], "vocabulary"),
    # predict
    ("predict-language-model", ["predict", DONE, "hello"], "language model"),
    ("predict-missing", ["predict", "/no/such/run", "x"], "/no/such/run"),
    ("predict-no-inputs", ["predict", DONE], "inputs"),
    ("predict-missing-file", ["predict", DONE, "--file", "/no/such/list.txt"], "--file"),
    ("predict-batch", ["predict", DONE, "x", "--batch-size", "0"], "--batch-size"),
    ("predict-moved-model", ["predict", "moved_model.pt", "some text"], "model.pretrained"),
    # verify
    ("verify-nproc", ["verify", "--nproc", "0"], "--nproc"),
    ("verify-bad-number", ["verify", "training.lr=abc"], "training.lr"),
    ("verify-unknown-key", ["verify", "nope=1"], "nope"),
    ("verify-two-configs", ["verify", "ok.yaml", "ok.yaml"], "ok.yaml"),
    # study
    ("study-nproc", ["study", "--nproc", "0"], "--nproc"),
    ("study-nproc-word", ["study", "--nproc", "abc"], "--nproc"),
    ("study-set-form", ["study", "--set", "training.lr"], "--set"),
    ("study-set-empty", ["study", "--set", "training.lr=1e-3,"], "--set"),
    ("study-nnodes", ["study", "--nnodes", "0"], "--nnodes"),
    ("study-repeat", ["study", "--repeat", "0"], "--repeat"),
    ("study-budget", ["study", "--budget", "forever"], "--budget"),
    # report and status
    ("report-missing", ["report", "/no/such/dir"], "/no/such/dir"),
    ("report-nothing-finished", ["report", "empty_dir"], "empty_dir"),
    ("report-budget", ["report", DONE, "--budget", "forever"], "--budget"),
    ("status-missing", ["status", "/no/such/run"], "/no/such/run"),
]


@pytest.mark.parametrize("argv, phrase", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_nothing_changes(place, argv, phrase, monkeypatch, capfd):
    monkeypatch.chdir(place)
    before = tree_digest(place / "experiments")
    code = main(*argv)
    out, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, (code, err[-3000:])
    assert len(lines) == 1 and lines[0].startswith("ddplab: error:") and phrase in lines[0], err[-3000:]
    assert tree_digest(place / "experiments") == before  # existing folders byte-identical, no new folder


def test_enough_distinct_cases_over_every_command():
    assert len({c[0] for c in CASES}) == len(CASES) >= 45
    assert {c[1][0] for c in CASES} >= {"train", "study", "report", "predict", "generate", "verify"}


def test_a_held_run_folder_is_refused_naming_the_holder(place, monkeypatch, capfd):
    monkeypatch.chdir(place)
    before = tree_digest(place / "experiments" / "done")
    with RunLock(place / "experiments" / "open"):
        before_open = {k: v for k, v in tree_digest(place / "experiments" / "open").items()}
        code = main("train", *TRAIN, "experiment.name=open")
        err = capfd.readouterr().err
        assert tree_digest(place / "experiments" / "open") == before_open
    assert code == 2 and len(err.strip().splitlines()) == 1 and "is in use by another ddplab job (host" in err
    assert tree_digest(place / "experiments" / "done") == before


@pytest.mark.parametrize(
    "argv, phrase",
    [
        (["train", "--nproc-per-node", "2", *TRAIN, "data.path=empty.txt", "experiment.name=new"], "too little text"),
        (
            ["train", "--nproc-per-node", "2", *TRAIN, "training.weight_decay=0.5", "experiment.name=open"],
            "training.weight_decay",
        ),
    ],
    ids=["workers-find-an-empty-corpus", "launcher-finds-a-changed-config"],
)
def test_real_processes_print_one_line(place, argv, phrase):
    """Under the launcher, a user error that only the workers can see reaches the console once."""
    before = tree_digest(place / "experiments")
    proc = ddplab(*argv, cwd=place)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and phrase in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert tree_digest(place / "experiments") == before


def test_temperature_0_is_greedy_and_top_k_0_is_no_top_k(place, monkeypatch, capfd):
    """Formerly tracebacks: both are meaningful values, not bad input."""
    monkeypatch.chdir(place)
    texts = []
    for seed in ("1", "2"):
        assert main("generate", DONE, "--temperature", "0", "--max-new-tokens", "30", "--seed", seed) == 0
        texts.append(capfd.readouterr().out)
    assert texts[0] == texts[1] and len(texts[0].strip()) > 0  # greedy: the seed does not matter
    sampled = []
    for seed in ("1", "2"):
        assert (
            main("generate", DONE, "--top-k", "0", "--temperature", "2", "--max-new-tokens", "30", "--seed", seed) == 0
        )
        sampled.append(capfd.readouterr().out)
    assert sampled[0] != sampled[1]  # still sampling, over the whole vocabulary
