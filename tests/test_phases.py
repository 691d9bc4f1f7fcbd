"""The start-up breakdown: each phase's wall time, from the process's creation to its teardown."""

import json
import os
import time

from conftest import assert_ok, ddplab
from ddplab.engine.diagnosis import phases as phases_mod
from ddplab.engine.diagnosis.phases import Phases
from ddplab.runtime.handoff import Handoff


def test_process_start_is_in_the_past_and_phases_add_up(monkeypatch):
    started = phases_mod.process_started_at()
    assert started is not None and time.time() - 3600 < started <= time.time()
    monkeypatch.setenv(Handoff.variable("launched_at"), repr(started - 2.0))
    p = Phases()
    assert 1.9 < p.seconds["launcher_s"] < 2.1 and p.seconds["imports_s"] >= 0
    time.sleep(0.05)
    p.mark("data")
    p.mark("model")
    assert 0.05 <= p.seconds["data_s"] < 1 and p.seconds["model_s"] < 0.05
    d = p.as_dict()
    assert abs(d["total_s"] - sum(v for k, v in d.items() if k != "total_s")) < 0.01
    assert "data 0.0" in p.line() or "data 0.1" in p.line()


def test_first_step_split_off_training_by_an_optimizer_hook():
    import torch

    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    p = Phases()
    p.mark("model")
    p.watch_first_step(opt)
    time.sleep(0.05)  # before the first step: counted in first_step_s
    for _ in range(3):
        w.grad = torch.ones(2)
        opt.step()
        time.sleep(0.04)  # after it: counted in training_s
    p.mark("training")
    assert p.seconds["first_step_s"] >= 0.05 and p.seconds["training_s"] >= 0.12
    assert not opt._optimizer_step_post_hooks  # the hook removed itself after one step


def test_a_launched_run_records_its_phases(tmp_path):
    # Through the launcher (which starts torch's agent as a child), so launcher_s is there too.
    proc = ddplab(
        "train",
        "--nproc-per-node",
        "1",
        "model.name=cnn",
        "data.name=digits",
        "training.max_steps=1",
        "logging.trackers=[]",
        "logging.progress=false",
        "experiment.name=p",
        cwd=tmp_path,
    )
    assert_ok(proc)
    run = tmp_path / "experiments" / "p"
    got = json.loads((run / "metrics.json").read_text())["phases"]
    for key in (
        "launcher_s",
        "imports_s",
        "workload_s",
        "rendezvous_s",
        "data_s",
        "model_s",
        "run_folder_s",
        "trainer_s",
        "first_step_s",
        "training_s",
        "end_of_run_s",
        "teardown_s",
    ):
        assert got[key] >= 0, key
    # torch alone takes longer than that to import: in the agent, which forks the workers (commands/launch.py), or each
    assert got["launcher_s"] + got["imports_s"] > 0.1
    assert "phases (rank 0, wall time): launcher" in (run / "train.log").read_text().splitlines()[-1]
    assert json.loads((run / "metrics.json").read_text())["ddp"]["launcher"] == "torchrun"
    assert os.environ.get(Handoff.variable("launched_at")) is None


def test_the_launcher_checks_built_in_workloads_without_importing_torch(tmp_path):
    """The launcher validates the config before any worker starts; for ddplab's own models and
    data that needs no torch (each worker imports it once, in parallel)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from ddplab.registry import check_files, load_config\n"
        "from ddplab.engine.run_folder.lock import claim, resolve_run_dir\n"
        "from ddplab.commands.launch import run_workers\n"
        "for overrides in (['model.name=cnn', 'data.name=digits'], ['model.name=gpt', 'data.name=text'],\n"
        "                  ['model.name=transformer', 'data.name=synthetic_reviews'],\n"
        "                  ['model.name=vit', 'data.name=digits', 'data.image_size=32']):\n"
        "    cfg = load_config(None, overrides)\n"
        "    check_files(cfg)\n"
        "    resolve_run_dir(cfg)\n"
        "print(sorted(m for m in ('torch', 'torchvision', 'sklearn', 'matplotlib') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_image_size_checks_still_refuse_what_the_model_cannot_take(tmp_path):
    from ddplab.errors import UserError
    from ddplab.registry import load_config

    for overrides, words in (
        (["model.name=cnn", "data.image_size=5"], "at least 6x6"),
        (["model.name=vit", "data.image_size=30"], "patch_size=4 does not divide"),
    ):
        try:
            load_config(None, ["data.name=digits", *overrides])
        except UserError as err:
            assert words in str(err) and "data.image_size" in str(err)
        else:
            raise AssertionError(f"{overrides} accepted")


def test_a_run_keeps_the_start_up_heap_out_of_collections_and_gives_it_back(tmp_path, monkeypatch):
    """While a run trains, the objects alive at its start are frozen (a full collection skips
    them); the DDP model and optimizer made later are still collected at teardown. After the
    run, the collector is as it was."""
    import gc

    import ddplab

    seen = {}

    class Probe(ddplab.Callback):
        def on_train_start(self, view):
            seen["frozen"] = gc.get_freeze_count()
            # gc.get_objects() lists what collections scan, the frozen generation left out
            seen["model_scanned"] = any(o is view.model for o in gc.get_objects())

    monkeypatch.chdir(tmp_path)
    summary = ddplab.train(
        None,
        [
            "model.name=cnn",
            "data.name=digits",
            "training.max_steps=1",
            "logging.trackers=[]",
            "logging.progress=false",
            "experiment.name=g",
        ],
        callbacks=[Probe()],
    )
    assert summary["status"] == "complete"
    assert seen["frozen"] > 10_000  # torch's modules alone hold far more objects than that
    assert seen["model_scanned"]
    assert gc.get_freeze_count() == 0
