"""Each failure told for what it is: bad values refused before anything is written (one line naming the
field, exit 2), failures at run time in one line with exit 1 and `status: failed`, their cause kept in the
run folder (errors.py). Most cases call the CLI in this process (`ddplab.cli.main`)."""

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import warm

from conftest import TINY_GPT, _env, ddplab
from ddplab.api import train
from ddplab.cli import main
from ddplab.engine.run_folder import folder as run_folder
from ddplab.engine.run_folder.folder import RunFolder
from ddplab.engine.snapshots.read import load_snapshot
from ddplab.engine.snapshots.write import Checkpointer
from ddplab.errors import RunError, write_failed


def tree_digest(folder: Path) -> dict[str, str]:
    """Every file and folder under `folder` -> SHA-256 of its bytes ("dir" for a folder)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(folder.rglob("*"))
    }


def _run_here(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit:  # argparse's errors
        return exit.code


# ---------------------------------------------------------------------------- bad values: exit 2


def _alias_bomb() -> str:
    """Ten levels of ten aliases each: 10^10 values once expanded, a few hundred bytes of YAML."""
    lines = ["data:", "  options:", "    l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 10)]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def place(tmp_path_factory) -> Path:
    """A user's folder: an unfinished run folder `open` (as a crash leaves it), bad YAML files, a file."""
    root = tmp_path_factory.mktemp("values")
    run = root / "experiments" / "open"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("training:\n  lr: 0.003\n")
    (run / "metrics.json").write_text(json.dumps({"status": "running"}))
    files = {
        "nan.yaml": "training:\n  lr: .nan\n",
        "inf.yaml": "training:\n  clip_grad_norm: .inf\n",
        "seed.yaml": "experiment:\n  seed: 1.0e+30\n",
        "budget.yaml": f"training:\n  time_budget: {'9' * 400}\n",
        "lr.yaml": f"training:\n  lr: {'9' * 400}\n",
        "deep.yaml": "data:\n  options:\n    a: " + "[" * 5000 + "]" * 5000,
        "bomb.yaml": _alias_bomb(),
        "self.yaml": "data:\n  options:\n    a: &a [*a]\n",
        "twice.yaml": "training:\n  lr: 0.1\n  epochs: 2\n  lr: 0.5\n",
        "a_file": "not a folder\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)
    (root / "utf16.yaml").write_bytes("training:\n  lr: 0.001\n".encode("utf-16"))
    (root / "a_folder").mkdir()
    return root


NAME = ["experiment.name=open"]  # bad values aimed at an existing run folder, which must stay as it is
# (case id, argv, a phrase the one line must hold: the field)
VALUES = [
    ("yaml-nan", ["train", "nan.yaml", *NAME], "training.lr"),
    ("yaml-inf", ["train", "inf.yaml", *NAME], "training.clip_grad_norm"),
    ("yaml-seed-1e30", ["train", "seed.yaml", *NAME], "experiment.seed"),
    ("yaml-400-digit-budget", ["train", "budget.yaml", *NAME], "training.time_budget"),
    ("yaml-400-digit-lr", ["train", "lr.yaml", *NAME], "training.lr"),
    ("yaml-utf16", ["train", "utf16.yaml", *NAME], "not UTF-8"),
    ("yaml-5000-deep", ["train", "deep.yaml", *NAME], "nested more than 100"),
    ("yaml-alias-bomb", ["train", "bomb.yaml", *NAME], "expands to more than"),
    ("yaml-holds-itself", ["train", "self.yaml", *NAME], "holds itself"),
    ("yaml-key-twice", ["train", "twice.yaml", *NAME], "gives the key 'lr' twice (lines 2 and 4)"),
    ("lr-1e400", ["train", "training.lr=1e400", *NAME], "training.lr"),
    ("lr-nan", ["train", "training.lr=nan", *NAME], "training.lr"),
    ("batch-1e20", ["train", "training.batch_size=1e20", *NAME], "training.batch_size"),
    ("seed-1e30", ["train", "experiment.seed=1e30", *NAME], "experiment.seed"),
    ("seed-past-32-bits", ["train", "experiment.seed=4294967296", *NAME], "experiment.seed"),
    ("budget-400-digits", ["train", f"training.time_budget={'9' * 400}", *NAME], "training.time_budget"),
    ("budget-400-days", ["train", "training.time_budget=400d", *NAME], "training.time_budget"),
    ("timeout-1e20", ["train", "distributed.timeout=1e20", *NAME], "distributed.timeout"),
    ("stall-warning-inf", ["train", "distributed.stall_warning=1e999", *NAME], "distributed.stall_warning"),
    ("momentum-above-1", ["train", "training.momentum=1.5", *NAME], "training.momentum"),
    ("options-deep", ["train", "data.options.x=" + "[" * 200 + "]" * 200, *NAME], "data.options.x"),
    ("verify-tolerance-nan", ["verify", "--tolerance", "nan"], "--tolerance"),
    ("verify-tolerance-negative", ["verify", "--tolerance", "-1"], "--tolerance"),
    ("verify-weight-tolerance-inf", ["verify", "--weight-tolerance", "inf"], "--weight-tolerance"),
    ("verify-lr-1e400", ["verify", "training.lr=1e400"], "training.lr"),
    ("study-batch-1e20", ["study", "training.batch_size=1e20"], "training.batch_size"),
    ("generate-temperature-nan", ["generate", "experiments/open", "--temperature", "nan"], "--temperature"),
    ("report-output-file", ["report", "experiments/open", "--output", "a_file"], "a_file"),
    ("report-output-under-file", ["report", "experiments/open", "--output", "a_file/sub"], "a_file"),
    ("export-output-folder", ["export", "experiments/open", "--output", "a_folder"], "a_folder"),
    ("predict-output-folder", ["predict", "experiments/open", "x", "--output", "a_folder"], "a_folder"),
]


@pytest.mark.parametrize("argv, phrase", [c[1:] for c in VALUES], ids=[c[0] for c in VALUES])
def test_a_bad_value_is_one_line_exit_2_and_nothing_is_written(place, argv, phrase, monkeypatch, capfd):
    monkeypatch.chdir(place)
    before = tree_digest(place)
    start = time.monotonic()
    code = _run_here(argv)
    err = capfd.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, (code, err[-3000:])
    assert len(lines) == 1 and lines[0].startswith("ddplab: error:") and phrase in lines[0], err[-3000:]
    assert len(lines[0]) < 400  # a 400-digit value is shortened
    assert tree_digest(place) == before  # the run folder byte-identical, no lock, no new folder
    if argv[0] == "train":  # refused before torch is imported; an alias bomb is refused, not expanded
        assert time.monotonic() - start < 5


def test_a_yaml_file_of_sane_depth_and_aliases_still_loads(tmp_path):
    """The bounds refuse only the pathological: anchors and aliases and nested options keep working."""
    from ddplab.config.reading import read_config

    (tmp_path / "ok.yaml").write_text(
        "data:\n  options:\n    base: &b {width: 4, layers: [1, 2]}\n"
        "    copy: *b\n    deep: " + "[" * 50 + "]" * 50 + "\n"
    )
    cfg = read_config(tmp_path / "ok.yaml", ["training.lr=1e-3", "experiment.seed=2147483647"])
    assert cfg.data.options["copy"] == {"width": 4, "layers": [1, 2]} and cfg.training.lr == 1e-3


def test_a_bad_value_as_a_real_process_is_one_line(place):
    before = tree_digest(place)
    proc = ddplab("train", "utf16.yaml", *NAME, cwd=place)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "ddplab: error: config file utf16.yaml is not UTF-8 text (byte 0); save it as UTF-8"
    ], proc.stderr
    assert tree_digest(place) == before


# ---------------------------------------------------------------------------- failures at run time: exit 1

TRAIN = [*TINY_GPT, "generate.max_new_tokens=0", "training.max_steps=6", "logging.log_every=2"]


def _one_failure_line(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 1, (code, err[-3000:])
    assert len(lines) == 1 and lines[0].startswith("ddplab: failed: "), err[-3000:]
    return lines[0]


def _recorded_failed(run: Path) -> dict:
    """The run folder says failed, and keeps the traceback."""
    summary = json.loads((run / RunFolder.METRICS_JSON).read_text())
    assert summary["status"] == "failed" and summary["failure"]["summary"], summary
    assert "Traceback" in (run / RunFolder.LOGS / "rank0.log").read_text()
    return summary


def test_a_non_finite_loss_is_a_run_time_failure(corpus, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    code = _run_here(
        [
            "train",
            f"data.path={corpus}",
            *TRAIN,
            "training.lr=1e6",
            "training.clip_grad_norm=null",
            "experiment.name=nf",
        ]
    )
    line = _one_failure_line(code, capfd.readouterr().err)
    assert "non-finite loss at step" in line and "training.nonfinite" in line and "logging.log_every=2" in line
    assert "non-finite loss" in _recorded_failed(tmp_path / "experiments" / "nf")["failure"]["summary"]


BUGGY = """
import torch
import ddplab
from torch.utils.data import TensorDataset


def data(cfg):
    x = torch.randn(64, 6)
    if cfg.options.get("bug") == "data":
        return {"rows": 64}["columns"]
    return ddplab.Data(train=TensorDataset(x, x.sum(1)), val=TensorDataset(x[:16], x[:16].sum(1)),
                       task=ddplab.Regression())


class Net(torch.nn.Module):
    def __init__(self, bug):
        super().__init__()
        self.bug, self.calls, self.layer = bug, 0, torch.nn.Linear(6, 1)

    def forward(self, x):
        self.calls += 1
        if self.bug == "forward" and self.calls > 4:
            raise ValueError("a bug in forward")
        return self.layer(x)


def model(cfg, data):
    return Net(cfg.options.get("bug"))
"""


def _bug_line(code: int, err: str) -> str:
    line = _one_failure_line(code, err)
    assert "Traceback" not in err
    return line


def _line_of(text: str) -> int:
    return next(i for i, line in enumerate(BUGGY.splitlines(), 1) if text in line)


@pytest.mark.parametrize(
    "where, raised, statement", [("data", "KeyError", '["columns"]'), ("forward", "ValueError", "a bug in forward")]
)
def test_a_bug_in_a_workload_names_its_file_and_line(tmp_path, monkeypatch, capfd, where, raised, statement):
    """Raised while the data is built (before training) or in a forward pass (in training): exit 1."""
    monkeypatch.chdir(tmp_path)
    at_line = _line_of(statement)
    (tmp_path / "wl.py").write_text(BUGGY)
    code = _run_here(
        [
            "train",
            "model.name=wl.py:model",
            "data.name=wl.py:data",
            f"data.options.bug={where}",
            f"model.options.bug={where}",
            "logging.trackers=[]",
            "logging.progress=false",
            "training.max_steps=6",
            "training.batch_size=16",
            "experiment.name=bug",
        ]
    )
    line = _bug_line(code, capfd.readouterr().err)
    assert raised in line and f"wl.py:{at_line}" in line, line
    run = tmp_path / "experiments" / "bug"
    assert raised in _recorded_failed(run)["failure"]["summary"]
    assert f'wl.py", line {at_line}' in (run / RunFolder.LOGS / "rank0.log").read_text()


class _Stopped(Exception):
    """What a user's SIGTERM handler raises in the test below."""


def test_a_stop_signal_while_the_failure_is_reported_takes_effect_once_the_report_is_written(tmp_path, monkeypatch):
    """torchrun's agent, which saw another rank die, stops the job while this rank writes its report: the report is
    written whole, then the signal takes effect as it would have (here a handler of the program's own)."""
    from ddplab.engine.diagnosis import heartbeat

    monkeypatch.chdir(tmp_path)
    (tmp_path / "wl.py").write_text(BUGGY)
    compose = heartbeat.compose

    def stopped_while_composing(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)  # as the agent's SIGTERM lands in the report
        return compose(*args, **kwargs)

    monkeypatch.setattr(heartbeat, "compose", stopped_while_composing)
    run, seen = tmp_path / "experiments" / "bug", []

    def own_handler(signum, frame):
        seen.append(json.loads((run / RunFolder.METRICS_JSON).read_text())["status"])
        raise _Stopped

    before = signal.signal(signal.SIGTERM, own_handler)
    try:
        with pytest.raises(_Stopped):
            train(
                None,
                ["model.name=wl.py:model", "data.name=wl.py:data", "data.options.bug=forward"]
                + ["model.options.bug=forward", "logging.trackers=[]", "logging.progress=false"]
                + ["training.max_steps=6", "training.batch_size=16", "experiment.name=bug"],
            )
    finally:
        signal.signal(signal.SIGTERM, before)
    assert seen == ["failed"]  # the program's handler ran once, after the report
    assert "ValueError: a bug in forward" in _recorded_failed(run)["failure"]["summary"]
    assert "job failed: " in (run / RunFolder.LOG).read_text()


def test_a_full_disk_is_named_with_the_file_and_free_space(corpus, tmp_path, monkeypatch, capfd):
    """ENOSPC injected into the write of metrics.csv: one line naming it, exit 1, not a traceback."""
    monkeypatch.chdir(tmp_path)
    real = run_folder.write_atomic

    def full(folder, name, content, *args, **kwargs):
        if str(name) == RunFolder.METRICS_CSV:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(folder, name, content, *args, **kwargs)

    monkeypatch.setattr(run_folder, "write_atomic", full)
    code = _run_here(
        [
            "train",
            f"data.path={corpus}",
            *TRAIN,
            "training.max_steps=null",
            "training.epochs=1",
            "data.limit=64",
            "experiment.name=full",
        ]
    )
    line = _one_failure_line(code, capfd.readouterr().err)
    run = tmp_path / "experiments" / "full"
    assert line.startswith(
        f"ddplab: failed: no space left on device writing experiments/full/{RunFolder.METRICS_CSV} ("
    )
    assert line.endswith(" free)")
    _recorded_failed(run)


def test_write_failed_tells_a_full_disk_from_other_errors(tmp_path):
    full = write_failed(tmp_path / "x", OSError(errno.ENOSPC, "No space left on device"))
    assert isinstance(full, RunError) and str(full).startswith(f"no space left on device writing {tmp_path / 'x'} (")
    try:  # a library that wraps the OSError (torch.save's writer) keeps it as the context
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError:
            raise RuntimeError("unexpected pos 400768 vs 400656") from None
    except RuntimeError as wrapped:
        assert str(write_failed(tmp_path / "y", wrapped)).startswith("no space left on device writing")
    denied = write_failed(tmp_path / "z", PermissionError(errno.EACCES, "Permission denied"))
    assert str(denied) == f"cannot write {tmp_path / 'z'}: Permission denied"


def _tmpfs(folder: Path, size: str) -> bool:
    folder.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        return False
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True
        ).returncode
        == 0
    )


def test_a_real_full_disk_ends_in_one_line_and_a_later_resume_is_exact(corpus, tmp_path, monkeypatch, capfd):
    """End to end on a 1 MB tmpfs (where the machine lets us mount one): snapshots fill it. Given room,
    the same command continues from the last complete snapshot and ends as a run never interrupted. Each run
    is one process, this one."""
    disk = tmp_path / "disk"
    if not _tmpfs(disk, "1m"):
        pytest.skip("cannot mount a tmpfs here (needs root and mount)")
    monkeypatch.chdir(tmp_path)
    args = [
        "train",
        f"data.path={corpus}",
        *TINY_GPT,
        "generate.max_new_tokens=0",
        "training.max_steps=40",
        "checkpoint.every=2",
        "checkpoint.keep_last=10",
        "experiment.name=full",
    ]  # a few snapshots fit in 1 MB
    try:
        code = _run_here([*args, f"experiment.output_dir={disk}"])
        err = capfd.readouterr().err
        line = _one_failure_line(code, err)
        assert "no space left on device writing" in line and "Traceback" not in err
        assert json.loads((disk / "full" / RunFolder.METRICS_JSON).read_text())["status"] == "failed"
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        code = _run_here([*args, f"experiment.output_dir={disk}"])
        out, err = capfd.readouterr()
        assert code == 0 and "resumed from" in out, (out[-2000:], err[-2000:])
        weights = _final_weights(disk / "full")
    finally:
        subprocess.run(["umount", str(disk)], check=False)
    assert _run_here([*args, f"experiment.output_dir={tmp_path / 'ref'}"]) == 0, capfd.readouterr().err[-2000:]
    reference = _final_weights(tmp_path / "ref" / "full")
    assert weights.keys() == reference.keys() and all(torch.equal(weights[k], reference[k]) for k in reference)


def _final_weights(run: Path) -> dict:
    ck = Checkpointer(run / "checkpoints", is_main=False)
    return load_snapshot(ck.latest())["model"]


def test_under_the_launcher_a_non_finite_loss_is_one_line_exit_1(corpus, tmp_path):
    proc = ddplab(
        "train",
        "--nproc-per-node",
        "2",
        f"data.path={corpus}",
        *TRAIN,
        "training.lr=1e6",
        "training.clip_grad_norm=null",
        "experiment.name=nf",
        "distributed.timeout=60",
        cwd=tmp_path,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("ddplab: failed: rank ") and "non-finite loss at step" in lines[0]
    summary = json.loads((tmp_path / "experiments" / "nf" / "metrics.json").read_text())
    assert summary["status"] == "failed"


def _job_at_step_3(corpus, tmp_path, rank: int, timeout: float) -> tuple[subprocess.Popen, int, Path]:
    """A 2-process job under the launcher, and the PID of `rank` once it has reached step 3."""
    run = tmp_path / "experiments" / "job"
    proc = subprocess.Popen(
        warm.command(
            [
                sys.executable,
                "-m",
                "ddplab",
                "train",
                "--nproc-per-node",
                "2",
                f"data.path={corpus}",
                *TINY_GPT,
                "generate.max_new_tokens=0",
                "training.epochs=1000",
                "logging.log_every=1",
                f"distributed.timeout={timeout}",
                "distributed.stall_warning=3",
                "experiment.name=job",
            ]
        ),
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
        try:
            beat = json.loads((run / "heartbeat.json").read_text())["ranks"][str(rank)]
        except (OSError, ValueError, KeyError):
            continue
        if beat["step"] >= 3:
            return proc, beat["pid"], run
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"rank {rank} never reached step 3: {proc.communicate()[1][-3000:]}")


def _failed_within(run: Path, seconds: float) -> dict:
    """metrics.json once it says failed (waiting `seconds` at most)."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        summary = json.loads((run / "metrics.json").read_text())
        if summary.get("status") == "failed":
            return summary
        time.sleep(0.5)
    raise AssertionError(f"not failed after {seconds} s: {summary.get('status')}")


@pytest.mark.serial  # bounds the job's wall time (20.8 s against 20 beside the parallel pass in CI; 10.7 s alone)
def test_a_rank_stopped_with_sigstop_is_named_at_its_step_and_the_job_ends_within_the_timeout(corpus, tmp_path):
    """Rank 1 frozen (alive, not advancing, its heartbeat thread stopped with it): rank 0 warns after
    distributed.stall_warning; its report names rank 1, not itself, at the step it stopped at (its last heartbeat
    can be a second, many steps, older); and the whole job ends, every process gone, within the timeout + 10 s
    (it took 53 s with a timeout of 10: torchrun's agent waited 30 s for the stopped rank to act on SIGTERM; then
    20.4 s in 2 runs of 60: continued inside a gloo collective with rank 0 gone, rank 1 waited there for the timeout
    again, until the heartbeat's grace for a rank other than 0 ended it)."""
    timeout = 10
    proc, pid, run = _job_at_step_3(corpus, tmp_path, 1, timeout)
    try:
        workers = [b["pid"] for b in json.loads((run / "heartbeat.json").read_text())["ranks"].values()]
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        err = proc.communicate(timeout=timeout + 120)[1]
        took = time.monotonic() - stopped
        assert proc.returncode == 1 and "rank 1 stalled" in err, err[-3000:]
        failure = json.loads((run / "metrics.json").read_text())["failure"]
        assert failure["culprit"]["rank"] == 1 and "frozen" in failure["summary"], failure["summary"]
        told = (run / "train.log").read_text()
        assert "WARNING: rank 1" in told  # the stall warning, while the job still ran
        # Rank 0 logs a step after its loss is reduced with rank 1's: rank 1 took part in the last one logged, and
        # stopped in it or in the next.
        last = max(int(step) for step in re.findall(r"epoch \d+ step (\d+):", told))
        assert failure["culprit"]["step"] in (last, last + 1), (failure["summary"], last)
        assert took < timeout + 10, f"the job ended {took:.1f} s after the stop: {err[-2000:]}"
        assert not [p for p in workers if _running(p)], "a worker outlived the job"
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _running(pid: int) -> bool:
    """Process `pid` exists and has not exited (a zombie left for init to reap has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_when_rank_0_dies_rank_1_writes_the_report(corpus, tmp_path):
    proc, pid, run = _job_at_step_3(corpus, tmp_path, 0, 30)
    try:
        os.kill(pid, signal.SIGKILL)
        err = proc.communicate(timeout=120)[1]
        failure = json.loads((run / "metrics.json").read_text())["failure"]
        # Rank 1's report when it lives long enough to write it, else the launcher's from torchrun's summary.
        died = re.compile(r"rank 0 (\(host \S+\) )?died")
        assert failure["culprit"]["rank"] == 0 and died.search(failure["summary"]), failure
        assert proc.returncode == 1 and died.search(err) and "Traceback" not in err, err[-3000:]
        status = ddplab("status", str(run), cwd=tmp_path)
        assert died.match(status.stdout.removeprefix("failed: ")), status.stdout
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


_STUCK_LOADER = """
import os, signal, sys, threading, time
import torch
from ddplab.engine.loop.loaders import {init}

class Stuck(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        open(sys.argv[1], "w").write(str(os.getpid()))
        threading.Event().wait()  # a worker stuck for good: in a lock, a read that never returns

loader = torch.utils.data.DataLoader(Stuck(), num_workers=1, worker_init_fn={init})
it = iter(loader)
while not (os.path.exists(sys.argv[1]) and os.path.getsize(sys.argv[1])):
    time.sleep(0.05)
os.kill(os.getpid(), signal.SIGKILL)  # the rank dies, as a SIGKILLed or faulthandler-ended one does
"""


def test_a_loader_worker_stuck_for_good_dies_with_its_rank(tmp_path):
    """A DataLoader worker notices its rank's end only while it waits for work; one stuck in __getitem__ would
    outlive it (and hold the job's output pipes). ddplab's loaders end their workers with their rank."""
    pid_file = tmp_path / "worker.pid"
    script = _STUCK_LOADER.format(init="_worker_init")
    proc = subprocess.run([sys.executable, "-c", script, str(pid_file)], env=_env(), timeout=120, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    worker = int(pid_file.read_text())
    for _ in range(100):  # the kernel's signal is immediate; the worker's exit takes a moment
        if not Path(f"/proc/{worker}").exists() or "Z" in Path(f"/proc/{worker}/stat").read_text().split()[2]:
            break
        time.sleep(0.05)
    else:
        os.kill(worker, signal.SIGKILL)
        raise AssertionError(f"loader worker {worker} outlived its rank")


@pytest.mark.parametrize("path", ["torch", "/opt/venvs/ml/lib/python3.11/site-packages/torch"])
def test_the_launcher_hides_torchruns_failure_summary_however_torch_names_its_files(tmp_path, path, capfd):
    import io
    from collections import deque

    from ddplab.commands.launch import _pump

    agent = f"W1128 17:10:49.261000 21629 {path}/distributed/elastic/multiprocessing/api.py:900] Sending process"
    lines = [
        "epoch 1 step 1: loss 4.1\n",
        f"{agent} 123 closing signal SIGTERM\n",
        "Traceback (most recent call last):\n",
    ]
    _pump(io.BytesIO("".join(lines).encode()), tmp_path, deque())
    assert capfd.readouterr().err == lines[0]  # the agent's failure summary and traceback are the launcher's to say
