"""When a job goes wrong: real 2-process gloo jobs with user workloads written for the test. A rank
that stalls in its forward or in its dataset's __getitem__ is named, with the user's file and
function, within the timeout plus a margin; `ddplab status` says failed; a rank 2x slower per
step is named a straggler; the ETA made at the end of epoch 1 of 3 is close to the actual end."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import warm

from conftest import _env, ddplab, main

WORKLOAD = textwrap.dedent("""
    import os, time
    import torch
    import ddplab

    RANK = int(os.environ.get("RANK", 0))
    CALLS = {"forward": 0, "getitem": 0}


    class Items(torch.utils.data.Dataset):
        def __init__(self, stall_rank, stall_call):
            g = torch.Generator().manual_seed(0)
            self.x = torch.randn(256, 8, generator=g)
            self.y = (self.x[:, 0] > 0).long()
            self.stall_rank, self.stall_call = stall_rank, stall_call

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            CALLS["getitem"] += 1
            if RANK == self.stall_rank and CALLS["getitem"] == self.stall_call:
                time.sleep(300)
            return self.x[i], self.y[i]


    class Net(torch.nn.Module):
        def __init__(self, o):
            super().__init__()
            self.lin = torch.nn.Linear(8, 2)
            self.o = o

        def forward(self, x):
            if self.training:
                CALLS["forward"] += 1
                if RANK == int(self.o.get("stall_rank", -1)) and CALLS["forward"] == int(self.o.get("stall_call", 0)):
                    time.sleep(300)
                # Rank 1 takes twice rank 0's time every step.
                time.sleep(float(self.o.get("delay", 0)) * (2 if RANK == 1 else 1))
            return self.lin(x)


    def data(cfg):
        o = cfg.options
        items = Items(int(o.get("stall_rank", -1)), int(o.get("stall_call", 0)))
        return ddplab.Data(train=items, val=items, task=ddplab.Classification(2))


    def model(cfg, data):
        return Net(cfg.options)
""")
TIMEOUT = 8  # distributed.timeout of the stalling jobs
MARGIN = 30  # start-up of two workers on a loaded 2-core machine, and the ranks' teardown


def _args(tmp_path: Path, name: str, *extra: str) -> list[str]:
    (tmp_path / "hang.py").write_text(WORKLOAD)
    return [
        "train",
        "model.name=hang.py:model",
        "data.name=hang.py:data",
        "training.batch_size=16",
        "logging.trackers=[]",
        "logging.progress=false",
        f"experiment.name={name}",
        *extra,
    ]


def _stalled_job(tmp_path, name, cmd_head, *extra):
    t0 = time.time()
    proc = subprocess.run(
        warm.command(
            [
                *cmd_head,
                *_args(
                    tmp_path,
                    name,
                    f"distributed.timeout={TIMEOUT}",
                    "distributed.stall_warning=3",
                    "training.epochs=1",
                    *extra,
                ),
            ]
        ),
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT + 120,
    )
    return proc, time.time() - t0, tmp_path / "experiments" / name


@pytest.mark.serial  # bounds the job's wall time
def test_a_rank_stalled_in_forward_is_named_with_the_users_file_and_the_job_ends(tmp_path, capfd):
    proc, took, run = _stalled_job(
        tmp_path,
        "fwd",
        [sys.executable, "-m", "ddplab"],
        "--nproc-per-node",
        "2",
        "model.options.stall_rank=1",
        "model.options.stall_call=5",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert took < TIMEOUT + MARGIN
    head = "rank 1 stalled in forward at step 5"
    assert head in proc.stderr and f"{tmp_path / 'hang.py'}:" in proc.stderr and "in forward" in proc.stderr
    assert "waited in DDP gradient all_reduce" in proc.stderr  # what rank 0 was doing meanwhile
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) < 15, proc.stderr
    log = (run / "train.log").read_text()
    assert "WARNING: rank 1" in log and "phase forward, step 5" in log  # while the job still ran
    assert head in log
    failure = json.loads((run / "metrics.json").read_text())["failure"]
    assert failure["culprit"]["rank"] == 1 and failure["culprit"]["where"]["function"] == "forward"
    assert "hang.py" in (run / "logs" / "rank1.log").read_text()  # the stalled rank's stack, dumped
    assert main("status", str(run)) == 1
    status = capfd.readouterr().out
    assert status.startswith(f"failed: {head}") and status.count("\n") == 1, status


@pytest.mark.serial  # bounds the job's wall time
def test_rank_0_stalled_in_its_datasets_getitem_under_plain_torchrun(tmp_path, capfd):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "ddplab"]
    proc, took, run = _stalled_job(
        tmp_path, "data", torchrun, "data.options.stall_rank=0", "data.options.stall_call=40"
    )
    assert proc.returncode != 0
    assert took < TIMEOUT + MARGIN
    failure = json.loads((run / "metrics.json").read_text())["failure"]
    culprit = failure["culprit"]
    assert (culprit["rank"], culprit["phase"], culprit["where"]["function"]) == (0, "data", "__getitem__"), failure
    assert culprit["where"]["file"] == str(tmp_path / "hang.py")
    # The workers print the report and no traceback; what follows it is torchrun's own failure summary.
    ours = proc.stderr.split("Traceback (most recent call last)")[0]
    assert "rank 0 stalled in data" in ours and "File " not in ours, proc.stderr
    assert main("status", str(run)) == 1
    status = capfd.readouterr().out
    assert status.startswith("failed: rank 0 stalled in data") and status.count("\n") == 1, status


@pytest.mark.serial  # the ETA is checked against the wall clock
def test_a_slow_rank_is_named_a_straggler_and_the_eta_is_close(tmp_path):
    proc = ddplab(
        *_args(
            tmp_path,
            "slow",
            "--nproc-per-node",
            "2",
            "model.options.delay=0.03",
            "training.epochs=3",
            "logging.log_every=2",
        ),
        cwd=tmp_path,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "experiments" / "slow"
    lines = [line for line in (run / "train.log").read_text().splitlines() if "straggler" in line]
    assert len(lines) == 1 and "straggler: rank 1 " in lines[0] and "compute" in lines[0], lines
    rows = (run / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert {row.split(",")[header.index("slowest_rank")] for row in rows[1:]} == {"1"}
    summary = json.loads((run / "metrics.json").read_text())
    first = summary["eta"]["estimates"][0]
    assert first["epoch"] == 1 and abs(first["error"]) < 0.25, summary["eta"]
    assert "ETA" in [line for line in proc.stdout.splitlines() if line.startswith("epoch 1:")][0]


def test_status_of_a_live_run_gives_its_step_and_eta(tmp_path, capfd):
    """In this process: the heartbeat's age is read to the second, which a process's start-up would change."""
    from ddplab.engine.run_folder.lock import RunLock

    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.json").write_text(json.dumps({"status": "running"}))
    (run / "heartbeat.json").write_text(
        json.dumps(
            {
                "time": time.time(),
                "ranks": {"0": {"step": 7, "still_s": 2}},
                "progress": {"elapsed_s": 65, "eta_s": 130, "at": time.time()},
            }
        )
    )
    with RunLock(run):
        main("status", str(run))
    live = capfd.readouterr().out
    assert live.startswith("running: step 7 (2s ago), elapsed 1m05s, ETA 2m10s"), live
    assert main("status", str(run)) == 1  # the lock's owner is gone, and no report was written
    assert capfd.readouterr().out == "failed: the job ended without a report (killed?); see train.log\n"


def test_ctrl_c_under_plain_torchrun_snapshots_and_the_status_says_interrupted(tmp_path, capfd):
    """The terminal's SIGINT reaches the agent and both workers (one process group), and the agent
    forwards it once more: the workers stop at the next step, snapshot, and exit 130."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "ddplab",
        *_args(tmp_path, "int", "model.options.delay=0.05", "training.epochs=20", "logging.log_every=1"),
    ]
    out = tmp_path / "out.txt"
    proc = subprocess.Popen(
        warm.command(cmd),
        cwd=tmp_path,
        env=_env(),
        stdout=open(out, "w"),
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.time() + 120
    while "step 2:" not in out.read_text():
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() is not None else ""
        time.sleep(0.1)
    os.killpg(warm.stands_for(proc.pid), signal.SIGINT)  # Ctrl-C, to the group of the agent and its workers
    _, err = proc.communicate(timeout=60)
    assert main("status", str(tmp_path / "experiments" / "int")) == 130, err[-2000:]
    assert capfd.readouterr().out == "interrupted\n"
    assert list((tmp_path / "experiments" / "int" / "checkpoints").glob("step-*/COMPLETE"))


def _without_torch_variables(monkeypatch) -> None:
    """The user's settings of the flight recorder, none; and the test's own do not outlive it."""
    monkeypatch.setattr(
        os, "environ", {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_FR", "TORCH_NCCL"))}
    )


def test_the_report_names_the_collective_a_flight_recorder_dump_shows_unfinished(tmp_path, monkeypatch):
    """A real dump of torch's flight recorder (gloo records too): rank 0 entered an all_reduce rank 1 never joined."""
    import threading
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ddplab.engine.diagnosis import flight_recorder
    from ddplab.engine.diagnosis.failure import compose

    store, groups = dist.HashStore(), {}
    joins = [
        threading.Thread(
            target=lambda r=r: groups.update({r: dist.ProcessGroupGloo(store, r, 2, timedelta(seconds=30))})
        )
        for r in (0, 1)
    ]
    [t.start() for t in joins]
    [t.join() for t in joins]
    pending = groups[0].allreduce([torch.ones(3)])
    dump = torch._C._distributed_c10d._dump_fr_trace()
    groups[1].allreduce([torch.ones(3)]).wait()
    pending.wait()

    _without_torch_variables(monkeypatch)
    flight_recorder.dump_into(tmp_path / "logs", "gloo")
    assert flight_recorder.unfinished(0) == {}  # not NCCL: no dump is asked for
    flight_recorder.dump_into(tmp_path / "logs", "nccl")
    (tmp_path / "logs" / "nccl_trace_rank_0").write_bytes(dump)
    assert flight_recorder.unfinished(time.time() + 60) == {}  # an earlier attempt's dump
    stuck = flight_recorder.unfinished(0)
    assert stuck[0]["collective"] == "gloo:all_reduce" and stuck[0]["sizes"] == [[3]], stuck
    report = compose({}, {0: {"error": "DistBackendError: timeout"}}, 2, tmp_path, stuck)["report"]
    assert f"rank 0 never completed gloo:all_reduce #{stuck[0]['seq']} of process group" in report, report


def test_on_nccl_the_flight_recorder_dumps_on_a_timeout_unless_the_user_said_otherwise(monkeypatch):
    from ddplab.engine.diagnosis import flight_recorder

    _without_torch_variables(monkeypatch)
    flight_recorder.arm("gloo")
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in os.environ
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "50")
    flight_recorder.arm("nccl")
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ


def test_every_package_of_ddplab_is_its_own_code_when_it_is_installed_among_the_libraries(monkeypatch):
    import ddplab as package
    from ddplab.engine.diagnosis import failure

    ours = Path(package.__file__).resolve().parent
    monkeypatch.setattr(failure, "_LIBRARIES", (str(ours.parent),))  # installed in site-packages
    assert not failure._library(str(ours / "data" / "stream.py"))  # a workload's data pipeline: ddplab's own
    assert not failure._library(str(ours / "engine" / "loop" / "trainer.py"))
    assert failure._library(str(ours.parent / "torch" / "nn" / "modules" / "module.py"))
