"""Predict and generate from the run folder alone: what inference needs of the data is saved into the
run folder's inference/ when training starts, and the training data may then be deleted.

(A data function whose result differs across ranks, a vocabulary built on each rank, is refused before
training: tests/test_hf_data.py::test_data_that_differs_between_ranks_is_refused_before_training.)"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from test_vision_data import image_tree

import ddplab
from conftest import main
from ddplab.commands.predict import predict
from ddplab.commands.trained_model import load_model, sample
from ddplab.engine.run_folder import assets
from ddplab.engine.run_folder.folder import RunFolder
from ddplab.errors import RunError
from ddplab.workloads.char_lm import embedded_corpus

FAST = ["logging.trackers=[]", "logging.progress=false", "training.warmup_steps=0", "generate.max_new_tokens=0"]

VOCABULARY = '''
import json
from pathlib import Path

import torch
import ddplab

WORDS = "good great fine bad awful poor".split()


class Words:
    """One input's words -> their ids in the vocabulary file; unknown words are id 0."""

    def __init__(self, path):
        self.ids = json.loads(Path(path).read_text())

    def __call__(self, text):
        return torch.tensor([self.ids.get(w, 0) for w in text.split()][:3] + [0] * (3 - min(len(text.split()), 3)))


def data(cfg):
    if cfg.assets is not None:  # ddplab predict: the vocabulary the run saved
        return ddplab.Data(train=None, preprocess=Words(cfg.assets.path("vocab")))
    lines = Path("train.txt").read_text().splitlines()
    Path("vocab.json").write_text(json.dumps({w: i + 1 for i, w in enumerate(sorted({*" ".join(lines).split()}))}))
    words = Words("vocab.json")
    items = [(words(line), int(line.split()[0] in WORDS[:3])) for line in lines]
    return ddplab.Data(train=items and Items(items), task=ddplab.Classification(2, ["neg", "pos"]),
                       preprocess=words, assets={"vocab": "vocab.json"})


class Items(torch.utils.data.Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def model(cfg, data):
    return torch.nn.Sequential(torch.nn.EmbeddingBag(8, 8), torch.nn.Linear(8, 2))
'''


def _train(place: Path, monkeypatch, *overrides: str) -> Path:
    monkeypatch.chdir(place)
    ddplab.train(None, [*overrides, "experiment.name=run", *FAST])
    return place / "experiments" / "run"


def _same_rows(before: list[dict], after: list[dict]) -> None:
    assert [r["label"] for r in after] == [r["label"] for r in before]
    assert [r["probability"] for r in after] == pytest.approx([r["probability"] for r in before], abs=1e-6)


def test_text_classification_predicts_after_its_csv_and_cache_are_deleted(tmp_path, monkeypatch):
    rows = [("a wonderful film, loved it", "pos"), ("dull and far too long", "neg")] * 40
    (tmp_path / "train.csv").write_text("text,label\n" + "".join(f'"{t}",{y}\n' for t, y in rows))
    run = _train(
        tmp_path,
        monkeypatch,
        "model.name=transformer",
        "data.name=text_files",
        "data.train=train.csv",
        "data.max_len=16",
        "data.vocab_size=512",
        "model.layers=1",
        "model.dim=16",
        "model.heads=2",
        "training.batch_size=16",
        "training.epochs=4",
        "training.lr=1e-2",
        f"data.cache_dir={tmp_path / 'cache'}",
    )
    saved = json.loads((run / "inference" / "assets.json").read_text())
    assert saved["task"]["class_names"] == ["neg", "pos"] and saved["meta"]["tokenizer"] == "hash"
    target = {"dtype": "int64", "shape": []}
    assert saved["example"] == {"kind": "dict", "field": "label", "target": target, "input_dtype": None}
    inputs = ["a wonderful film", "far too long", "an unknown word"]
    before = predict(str(run), inputs)

    (tmp_path / "train.csv").unlink()
    shutil.rmtree(tmp_path / "cache")
    after = predict(str(run), inputs)
    _same_rows(before, after)
    assert [r["label"] for r in after[:2]] == ["pos", "neg"]
    shutil.rmtree(run / "inference")  # as for a checkpoint taken away from its run folder: the rebuilt data's form
    _same_rows(before, predict(str(run), inputs))


def test_an_image_folder_run_predicts_after_its_images_are_deleted(tmp_path, monkeypatch):
    image_tree(tmp_path / "tree", classes=2, per_class=4, side=12)
    shutil.copy(tmp_path / "tree" / "val" / "class_1" / "0.png", tmp_path / "new.png")
    run = _train(
        tmp_path,
        monkeypatch,
        "model.name=cnn",
        "data.name=image_folder",
        f"data.root={tmp_path / 'tree'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "training.batch_size=4",
        "training.epochs=4",
        "training.lr=1e-2",
    )
    before = predict(str(run), ["new.png"])

    shutil.rmtree(tmp_path / "tree")
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)
    after = predict(str(run), ["new.png"])
    _same_rows(before, after)
    assert after[0]["label"] == "class_1"


def test_a_character_model_generates_after_its_corpus_is_deleted(tmp_path, monkeypatch):
    (tmp_path / "corpus.txt").write_text(embedded_corpus()[:20_000])
    run = _train(
        tmp_path,
        monkeypatch,
        "model.name=gpt",
        "data.name=text",
        "data.path=corpus.txt",
        "model.layers=1",
        "model.dim=16",
        "model.heads=2",
        "model.context=16",
        "training.batch_size=8",
        "training.max_steps=5",
    )

    def generated() -> str:
        model, ckpt, _ = load_model(run)
        return sample(model, ckpt["meta"], "HAMLET", 30, temperature=0.8, top_k=5, seed=3)

    before = generated()
    (tmp_path / "corpus.txt").unlink()
    assert generated() == before and before.startswith("HAMLET") and len(before) == len("HAMLET") + 30


def test_a_workload_of_your_own_saves_its_vocabulary_and_predicts_from_it(tmp_path, monkeypatch, capfd):
    (tmp_path / "work.py").write_text(VOCABULARY)
    (tmp_path / "train.txt").write_text("\n".join(["good great", "bad awful", "fine good", "poor bad"] * 8))
    run = _train(
        tmp_path,
        monkeypatch,
        "model.name=work.py:model",
        "data.name=work.py:data",
        "training.epochs=20",
        "training.batch_size=8",
        "training.lr=5e-2",
    )
    assert json.loads((run / "inference" / "vocab" / "vocab.json").read_text())["awful"] == 1
    before = predict(str(run), ["good great", "bad poor"])

    for name in ("train.txt", "vocab.json"):
        (tmp_path / name).unlink()
    after = predict(str(run), ["good great", "bad poor"])
    _same_rows(before, after)
    assert [r["label"] for r in after] == ["pos", "neg"]

    # A run folder from elsewhere whose assets.json leads out of it: refused in one line, nothing read.
    (tmp_path / "evil.json").write_text('{"good": 1, "great": 1, "bad": 1, "poor": 1}')
    index = json.loads((run / "inference" / "assets.json").read_text())
    index["files"]["vocab"] = "../../../evil.json"
    (run / "inference" / "assets.json").write_text(json.dumps(index))
    capfd.readouterr()
    assert main("predict", str(run), "good great") == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "'../../../evil.json' is not a path inside the run folder's inference/" in err


def test_data_assets_that_do_not_exist_are_one_line_before_a_run_folder(tmp_path, monkeypatch, capfd):
    (tmp_path / "work.py").write_text(VOCABULARY.replace('assets={"vocab": "vocab.json"}', 'assets={"vocab": "gone"}'))
    (tmp_path / "train.txt").write_text("good great\nbad awful\n")
    monkeypatch.chdir(tmp_path)
    code = main("train", "model.name=work.py:model", "data.name=work.py:data", "experiment.name=bad", *FAST)
    err = [line for line in capfd.readouterr().err.strip().splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and "Data.assets['vocab'] = 'gone' is no file or folder" in err[0], err
    assert not (tmp_path / "experiments" / "bad").exists()


def test_inference_files_are_never_written_through_a_link(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = RunFolder(tmp_path / "run", is_main=True)
    (run.path / "inference").symlink_to(elsewhere)  # planted in a run folder about to be resumed
    (tmp_path / "vocab.json").write_text("{}")
    data = ddplab.Data(
        train=[(torch.zeros(2), 1)], task=ddplab.Classification(2), assets={"vocab": tmp_path / "vocab.json"}
    )
    with pytest.raises(RunError, match="symbolic link"):
        assets.save(run, data)
    run.close()
    assert list(elsewhere.iterdir()) == []


def test_a_folder_asset_is_saved_whole_once_and_found_from_a_snapshot(tmp_path):
    (tmp_path / "tok" / "sub").mkdir(parents=True)
    (tmp_path / "tok" / "tokenizer.json").write_text('{"a": 1}')
    (tmp_path / "tok" / "sub" / "merges.txt").write_text("a b\n")
    run = RunFolder(tmp_path / "run", is_main=True)
    item = {"input_ids": torch.ones(3, dtype=torch.long), "labels": torch.tensor([0.5])}  # holds its target
    data = ddplab.Data(train=[item], task=ddplab.Regression(), meta={"max_len": 8}, assets={"tok": tmp_path / "tok"})
    assets.save(run, data)
    written = (run.path / "inference" / "assets.json").read_text()
    data.meta, data.assets = {"max_len": 9}, {}
    assets.save(run, data)  # a resume leaves what the first start saved
    assert (run.path / "inference" / "assets.json").read_text() == written
    run.close()
    snapshot = run.path / "checkpoints" / "step-000000001"
    snapshot.mkdir(parents=True)
    saved, example = assets.load(snapshot, {"max_len": 8}, ddplab.Regression())
    assert (saved.path("tok") / "tokenizer.json").read_text() == '{"a": 1}'
    assert (saved.path("tok") / "sub" / "merges.txt").read_text() == "a b\n"
    assert example == {
        "kind": "dict",
        "field": "labels",
        "target": {"dtype": "float32", "shape": [1]},
        "input_dtype": None,
    }
    with pytest.raises(ddplab.UserError, match=r"saved: tok"):
        saved.path("vocab")


def _saved_run(tmp_path: Path, index: dict) -> Path:
    """A run folder's snapshot whose inference/ holds `index` as assets.json and a file stats.json."""
    inference = tmp_path / "run" / "inference"
    inference.mkdir(parents=True)
    (inference / "stats.json").write_text("{}")
    (inference / "assets.json").write_text(json.dumps(index))
    (tmp_path / "run" / "checkpoints" / "best").mkdir(parents=True)
    return tmp_path / "run" / "checkpoints" / "best"


def _outside(tmp_path: Path) -> Path:
    (tmp_path / "evil_stats.json").write_text('{"mean": 15175}')
    return tmp_path / "evil_stats.json"


def _link(tmp_path: Path, at: str) -> dict:
    (tmp_path / "run" / "inference" / at).unlink(missing_ok=True)
    (tmp_path / "run" / "inference" / at).symlink_to(_outside(tmp_path))
    return {"files": {"stats": at}}


@pytest.mark.parametrize(
    "files, says",
    [
        ({"stats": "../../../evil_stats.json"}, "is not a path inside the run folder's inference/"),
        ({"stats": "/etc/hostname"}, "is not a path inside the run folder's inference/"),
        ({"stats": 5}, "is not a path inside the run folder's inference/"),
        ({"stats": "gone.json"}, "no such file in the run folder's inference/"),
        (["stats.json"], "files is a list, not a dict"),
    ],
)
def test_inference_files_that_leave_the_run_folder_are_refused(tmp_path, files, says):
    found = _saved_run(tmp_path, {"files": files})
    with pytest.raises(ddplab.UserError, match=re.escape(says)):
        assets.load(found, {}, ddplab.Regression())


@pytest.mark.parametrize("at", ["stats.json", "linked.json", "folder/inner.json"])
def test_a_link_under_inference_is_refused(tmp_path, at):
    found = _saved_run(tmp_path, {})
    (tmp_path / "run" / "inference" / "folder").mkdir()
    (tmp_path / "run" / "inference" / "assets.json").write_text(
        json.dumps({"files": {"stats": at.split("/")[0]}} if "/" in at else _link(tmp_path, at))
    )
    if "/" in at:
        (tmp_path / "run" / "inference" / at).symlink_to(_outside(tmp_path))
    with pytest.raises(ddplab.UserError, match="is a symbolic link, which could lead outside the run folder"):
        assets.load(found, {}, ddplab.Regression())
    (tmp_path / "run" / "inference" / "assets.json").unlink()
    (tmp_path / "run" / "inference" / "assets.json").symlink_to(_outside(tmp_path))  # the index itself
    with pytest.raises(ddplab.UserError, match="a symbolic link in the run folder's inference/"):
        assets.load(found, {}, ddplab.Regression())


@pytest.mark.parametrize(
    "index, says",
    [
        ([1, 2], "a JSON list, not the dict ddplab saved"),
        ({"example": [1]}, "example is a list, not a dict"),
        (
            {"example": {"kind": "pair", "target": {"dtype": "float32", "shape": [100000, 100000, 100]}}},
            "target shape [100000, 100000, 100] (1,000,000,000,000 values",
        ),
        ({"example": {"kind": "pair", "target": {"dtype": "bogus", "shape": [1]}}}, "target dtype 'bogus'"),
        ({"example": {"kind": "pair", "target": {"dtype": "float32", "shape": [-1]}}}, "target shape [-1]"),
        ({"example": {"kind": "pair", "input_dtype": "bogus"}}, "input_dtype 'bogus'"),
        ({"example": {"kind": "set"}}, "kind 'set'"),
        ({"example": {"kind": "dict", "target": "x"}}, "target 'x' (a number"),
    ],
)
def test_a_malformed_assets_json_is_one_line_before_anything_is_allocated(tmp_path, index, says):
    found = _saved_run(tmp_path, {})
    (tmp_path / "run" / "inference" / "assets.json").write_text(json.dumps(index))
    with pytest.raises(ddplab.UserError, match=re.escape(says)) as err:
        assets.load(found, {}, ddplab.Regression())
    assert "\n" not in str(err.value)


def test_a_malformed_assets_json_is_exit_2_from_predict(tmp_path, capfd):
    from test_snapshot import ONE, _parts

    from ddplab.engine.snapshots.write import Checkpointer, part

    found = _saved_run(tmp_path, {"example": {"kind": "pair", "target": {"dtype": "bogus", "shape": [1]}}})
    found.rmdir()
    parts = _parts(1.0, 1)
    parts.add("task", part(lambda: ddplab.Regression().describe()))  # not a language model
    Checkpointer(found.parent, is_main=True).save(parts, ONE, "best", {"step": 1, "config": {}})
    capfd.readouterr()
    assert main("predict", str(tmp_path / "run"), "1,2") == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ddplab: error: ") and "target dtype 'bogus'" in err, err
