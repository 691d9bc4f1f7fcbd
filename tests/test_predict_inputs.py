"""What predict gives a model: the inputs alone, never a made-up target (a seq2seq model generates through its
Task's own infer), and any text or number row whatever its length; a seq2seq model whose items carry labels
trains on the global token mean, so verify passes at 2 vs 1 process."""

from __future__ import annotations

import csv
from pathlib import Path

import hf_workloads

import ddplab
from conftest import assert_ok, verify
from ddplab.cli import main
from ddplab.commands.trained_model import load_model

HERE = Path(__file__).resolve().parent
S2S = [f"model.name={HERE / 'hf_workloads.py'}:t5", f"data.name={HERE / 'hf_workloads.py'}:seq2seq_data"]
FAST = ["logging.trackers=[]", "logging.progress=false", "distributed.timeout=60", "training.warmup_steps=0"]

NUMBERS = """
import torch
import ddplab
from torch.utils.data import TensorDataset


def data(cfg):
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()
    return ddplab.Data(train=TensorDataset(x, y), val=TensorDataset(x[:16], y[:16]),
                       task=ddplab.Classification(2, ["milton", "python_docs"]))


def model(cfg, data):
    return torch.nn.Linear(64, 2)
"""


def _predict(capfd, *argv: str) -> tuple[int, str, str]:
    capfd.readouterr()
    code = main(["predict", *argv])
    out, err = capfd.readouterr()
    return code, out, err


def test_a_seq2seq_model_whose_items_carry_labels_verifies_at_2_vs_1_process(tmp_path):
    """T5's loss is a mean over each batch's own target tokens: averaged per process, 2 x 4 differs from 1 x 8
    by about 1e-3 (the padding differs between batches); over the global count, by rounding."""
    proc = verify(
        "--nproc", "2", *S2S, "training.batch_size=4", "training.max_steps=4", "training.lr=0.01", cwd=tmp_path
    )
    assert_ok(proc)
    assert proc.stdout.strip().splitlines()[-1] == "PASS", proc.stdout
    loss_diff = float(proc.stdout.split("largest relative loss difference: ")[1].split()[0])
    assert loss_diff < 1e-5, proc.stdout


def test_a_task_that_counts_no_items_fails_verify_with_its_cause_named(tmp_path):
    proc = verify(
        "--nproc", "2", *S2S, "data.options.counts=false", "training.batch_size=4", "training.max_steps=2", cwd=tmp_path
    )
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 1 and lines[-1] == "FAIL", proc.stdout + proc.stderr
    assert any(line.startswith("loss: averaged per process over its own samples") for line in lines), proc.stdout


def test_collate_fn_gets_dict_items_without_a_target():
    from ddplab.commands.predict import _sample

    assert _sample({"kind": "dict", "field": "labels", "target": 0})({"input_ids": 1}) == {"input_ids": 1}
    inputs, target = _sample({"kind": "pair", "target": {"dtype": "int64", "shape": [3]}})("x")
    assert inputs == "x" and target.tolist() == [0, 0, 0]  # a stand-in of the training target's form


def test_predict_gives_what_the_tasks_own_infer_generates_and_without_it_one_line(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    for name, generates in (("gen", "true"), ("plain", "false")):
        ddplab.train(
            None,
            [*S2S, f"data.options.generates={generates}", "training.max_steps=2", "training.batch_size=8"]
            + [f"experiment.name={name}", *FAST],
        )
    code, out, _ = _predict(capfd, "experiments/gen", "reverse: hello", "reverse: ab")
    rows = [line.split("\t") for line in out.splitlines() if line]
    assert code == 0 and [r[-1] for r in rows] == ["reverse: hello", "reverse: ab"], out
    model = load_model("experiments/gen", trust_code=True)[0]
    for text, row in zip(["reverse: hello", "reverse: ab"], rows, strict=True):  # generated text, not logits
        generated = model.generate(input_ids=hf_workloads._ids(text)[None], max_new_tokens=8, do_sample=False)
        assert len(row) == 2 and row[0] == hf_workloads._text(generated[0].tolist()), out
    code, out, err = _predict(capfd, "experiments/plain", "reverse: hello")
    err = [line for line in err.splitlines() if not line.startswith("ddplab: importing")]
    assert code == 2 and not out and len(err) == 1, err
    assert "carried their target 'labels', which predict never makes up" in err[0] and "infer(model, inputs)" in err[0]


def test_a_300_character_sentence_and_a_64_number_row_are_inputs(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "numbers.py").write_text(NUMBERS)
    with open(tmp_path / "train.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        for i in range(32):
            w.writerow(["a fine and lovely film" if i % 2 else "a dull and tired film", i % 2])
    common = ["training.max_steps=2", "training.batch_size=8", *FAST]
    ddplab.train(None, ["model.name=numbers.py:model", "data.name=numbers.py:data", "experiment.name=n", *common])
    ddplab.train(
        None,
        ["model.name=transformer", "data.name=text_files", "data.train=train.csv", "data.max_len=64"]
        + ["model.layers=1", "model.dim=16", "model.heads=2", "experiment.name=t", *common],
    )
    sentence = ("the plot wanders and the actors look tired but the music is fine " * 5)[:300]
    row = ",".join(f"{i / 64:.3f}" for i in range(64))
    (tmp_path / "inputs.txt").write_text(sentence + "\n")
    (tmp_path / "rows.txt").write_text(row + "\n")
    code, out, err = _predict(capfd, "experiments/t", sentence, "--file", "inputs.txt")
    assert code == 0 and [line.split("\t")[-1] for line in out.strip().splitlines()] == [sentence] * 2, err
    code, out, err = _predict(capfd, "experiments/n", row, "--file", "rows.txt")
    lines = out.strip().splitlines()
    assert code == 0 and len(lines) == 2 and all(line.split("\t")[0] in ("milton", "python_docs") for line in lines)
