"""distributed.strategy=fsdp|hsdp with real gloo processes: sharded snapshots that resume bit-identically
and reshard to another world size, the global batch kept on such a resume (ddp too), async snapshots,
export, and the bad inputs of sharded training."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_fault_tolerance import _free_port, _summary, _trace, _weights, data  # noqa: F401 (data: a fixture)

import faults
from conftest import _env, assert_ok, ddplab, main, verify
from ddplab.engine.snapshots import manifest
from ddplab.engine.snapshots.read import step_snapshots
from ddplab.engine.snapshots.write import Checkpointer
from faults import agent_command, command
from references import SAMPLES, gpt_args


def _args(corpus: Path, name: str, strategy: str = "fsdp") -> list[str]:
    """references.gpt_args with 2 layers, a validation set ranks split unevenly, and `strategy`."""
    return [
        *gpt_args(corpus, name),
        "model.layers=2",
        "data.val_fraction=0.08",  # 49 validation chunks: one rank evaluates a batch more than the other
        f"distributed.strategy={strategy}",
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data) -> Path:
    """An fsdp job of 2 processes, never interrupted."""
    cwd = tmp_path_factory.mktemp("reference")
    args = _args(data, "ref")
    assert_ok(ddplab(args[0], "--nproc-per-node", "2", *args[1:], cwd=cwd))
    return cwd / "experiments" / "ref"


def _same_as(run: Path, reference: Path) -> None:
    mine, ref = _weights(run), _weights(reference)
    assert mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)
    losses = [[(r["step"], r["loss"]) for r in _summary(path)["steps"]] for path in (run, reference)]
    assert losses[0] == losses[1]  # every step's loss, bit for bit


def _run(spec: str, args: list[str], cwd: Path, nproc: int | None = None, max_restarts: int = 0):
    return subprocess.run(
        command(spec, args, nproc, max_restarts), cwd=cwd, env=_env(), capture_output=True, text=True, timeout=240
    )


def test_fsdp_shards_the_blocks_and_matches_ddp(reference):
    log = (reference / "train.log").read_text()
    latest = Checkpointer(reference / "checkpoints", False).latest()
    shards = sorted(p.name for p in (latest / "shards").iterdir())
    assert [n for n in shards if n.endswith(".distcp")] == ["__0_0.distcp", "__1_0.distcp"]  # each rank its own
    files = manifest.verify(latest)["files"]  # each rank checksummed its own shard: the manifest holds them all
    assert {"state.pt", "shards/.metadata", "shards/__0_0.distcp", "shards/__1_0.distcp"} <= files.keys()
    summary = _summary(reference)
    assert summary["ddp"]["strategy"] == "fsdp" and summary["ddp"]["ranks_identical"]
    assert summary["status"] == "complete" and summary["aggregates"]["steps"] == 12
    assert "global batch = 8 per process x 1 accumulation x 2 processes = 16" in log


def test_a_killed_fsdp_job_with_async_snapshots_resumes_bit_identically(tmp_path, data, reference):
    args = [*_args(data, "k"), "checkpoint.async_save=true"]
    # Killed at step 11: step 10's save waited for step 8's to complete on every rank, so step 8's is
    # on disk; step 10's may still be in flight (then it is left unmarked and step 8's is used).
    assert_ok(_run("kill_rank=1,step=11", args, tmp_path, nproc=2, max_restarts=1))
    run = tmp_path / "experiments" / "k"
    resumed = re.findall(r"resumed from \S+/step-0*(\d+)", (run / "train.log").read_text())
    assert resumed and int(resumed[0]) in (8, 10), resumed  # a mid-epoch snapshot written in the background
    _same_as(run, reference)  # and exact
    stalls = _summary(run)["ddp"]["snapshot_stalls"]
    assert stalls and all(s["async"] and s["stall_s"] > 0 for s in stalls)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_resume_on_one_process_keeps_the_global_batch_and_every_sample(tmp_path, data, strategy, monkeypatch, capfd):
    trace = tmp_path / "trace"
    args = _args(data, "w", strategy)
    _run(f"trace={trace},signal_rank=0,step=4", args, tmp_path, nproc=2)
    assert _summary(tmp_path / "experiments" / "w")["status"] == "preempted"
    monkeypatch.chdir(tmp_path)  # 2 -> 1 process: this one (a process adds nothing)
    assert faults.main([f"trace={trace}", *args], monkeypatch.setattr) == 0, capfd.readouterr().err[-3000:]
    out = capfd.readouterr().out
    assert "training.grad_accum_steps 1 -> 2: the global batch stays 16 on 1 processes" in out
    assert "global batch = 8 per process x 2 accumulation x 1 processes = 16" in out
    summary = _summary(tmp_path / "experiments" / "w")
    assert summary["aggregates"]["steps"] == 12 and summary["ddp"]["global"] == 16  # the same optimisation length
    for epoch, ranks in _trace(trace).items():
        seen = Counter(i for indices in ranks.values() for i in indices)
        assert sorted(seen) == list(range(SAMPLES)) and set(seen.values()) == {1}, epoch


@pytest.fixture(scope="module")
def preempted_at_2(tmp_path_factory, data) -> Path:
    """An fsdp job of 1 process (global batch 8), this one, pre-empted (SIGUSR1) after step 2; each test continues
    a copy of it."""
    cwd = tmp_path_factory.mktemp("preempted")
    with contextlib.chdir(cwd):
        assert faults.main(["signal_rank=0,step=2", *_args(data, "pre")]) == 75
    assert _summary(cwd / "experiments" / "pre")["status"] == "preempted"
    return cwd


def test_a_resume_on_more_processes_reshards_or_says_what_to_set(tmp_path, data, preempted_at_2, monkeypatch, capfd):
    args = _args(data, "pre")
    shutil.copytree(preempted_at_2, tmp_path, dirs_exist_ok=True)  # 1 process, global batch 8
    monkeypatch.chdir(tmp_path)
    code, refused = main(*args, "--nproc-per-node", "2"), capfd.readouterr().err  # the launcher, in this process
    assert code == 2 and refused.count("\n") == 1 and refused.startswith("ddplab: error: ")
    assert "cannot keep the run's global batch of 8 on 2 processes" in refused
    assert "set training.batch_size=4" in refused
    _run("signal_rank=1,step=6", [*args, "training.batch_size=4"], tmp_path, nproc=2)  # 1 -> 2, resharded
    assert _summary(tmp_path / "experiments" / "pre")["aggregates"]["steps"] == 6
    assert_ok(ddplab(args[0], "--nproc-per-node", "4", *args[1:], "training.batch_size=2", cwd=tmp_path))  # 2 -> 4
    summary = _summary(tmp_path / "experiments" / "pre")
    assert (
        summary["aggregates"]["steps"] == 24 and summary["ddp"]["global"] == 8 and summary["aggregates"]["resumes"] == 2
    )


def _two_nodes(spec: str, args: list[str], cwd: Path) -> list[subprocess.CompletedProcess]:
    """4 processes as 2 nodes x 2: two torchrun agents on loopback (LOCAL_WORLD_SIZE=2)."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            agent_command(
                [
                    "--nnodes=2",
                    "--nproc-per-node=2",
                    "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}",
                    f"--rdzv-id=t{port}",
                ],
                spec,
                args,
            ),
            cwd=cwd,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    return [p.communicate(timeout=240) and p for p in procs]


@pytest.fixture(scope="module")
def hsdp_preempted(tmp_path_factory, data) -> Path:
    """A 2-node hsdp job (2 x 2 processes, batch 4: the global batch of 16) pre-empted at step 4, each rank's
    samples traced into trace/. Each test resumes a copy of it its own way."""
    cwd = tmp_path_factory.mktemp("hsdp")
    _two_nodes(f"trace={cwd / 'trace'},signal_rank=3,step=4", _hsdp_args(data), cwd)
    assert _summary(cwd / "experiments" / "h")["status"] == "preempted"
    return cwd


def _hsdp_args(corpus: Path) -> list[str]:
    return [*_args(corpus, "h", "hsdp"), "training.batch_size=4"]  # 4 x 4 processes: the global batch of 16


def test_hsdp_on_two_nodes_resumes_bit_identically(tmp_path, data, hsdp_preempted):
    ref, run = tmp_path / "ref", tmp_path / "run"
    ref.mkdir()
    args = _hsdp_args(data)
    _two_nodes("", args, ref)
    shutil.copytree(hsdp_preempted, run)
    _two_nodes("", args, run)
    _same_as(run / "experiments" / "h", ref / "experiments" / "h")
    summary = _summary(ref / "experiments" / "h")
    assert summary["ddp"]["world_size"] == 4
    # 4 processes x batch 4 -> 6 steps an epoch, each with 3 gradient all-reduces across the nodes besides FSDP's 8
    assert summary["comm"]["timed"] == "all_gather, reduce_scatter, all_reduce across nodes"
    assert all(row["comm_calls"] == 66 and row["comm_time_s"] > 0 for row in summary["epochs"])


def test_hsdp_from_two_nodes_resumes_on_one_resharded_with_the_global_batch_kept(tmp_path, data, hsdp_preempted):
    shutil.copytree(hsdp_preempted, tmp_path, dirs_exist_ok=True)
    trace = tmp_path / "trace"
    proc = _run(f"trace={trace}", _hsdp_args(data), tmp_path, nproc=2)  # 2 x 2 -> 1 node of 2: the shards re-divided
    assert_ok(proc)
    assert "global batch = 4 per process x 2 accumulation x 2 processes = 16" in proc.stdout
    summary = _summary(tmp_path / "experiments" / "h")
    assert summary["aggregates"]["steps"] == 12 and summary["aggregates"]["resumes"] == 1
    for epoch, ranks in _trace(trace).items():
        seen = Counter(i for indices in ranks.values() for i in indices)
        assert sorted(seen) == list(range(SAMPLES)) and set(seen.values()) == {1}, epoch


def test_export_loads_into_a_fresh_model_without_ddplab(tmp_path, reference, capfd):
    from ddplab.commands.trained_model import load_model
    from ddplab.models.gpt import GPT, GPTConfig

    out = tmp_path / "model.safetensors"
    assert main("export", str(reference), "--output", str(out)) == 0
    assert str(out) in capfd.readouterr().out
    summary = _summary(reference)
    m = summary["config"]["model"]
    fresh = GPT(
        GPTConfig(
            vocab_size=summary["dataset"]["vocab_size"],
            context=m["context"],
            layers=m["layers"],
            heads=m["heads"],
            dim=m["dim"],
        )
    ).eval()
    fresh.load_state_dict(load_file(out))
    trained, _, _ = load_model(reference)
    idx = torch.randint(0, summary["dataset"]["vocab_size"], (2, 16))
    assert torch.equal(fresh(idx), trained(idx))


def test_bad_sharding_inputs_say_one_line(tmp_path, data, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    for extra, says in (
        (["distributed.comm_hook=fp16"], "distributed.comm_hook=fp16 is a DDP communication hook"),
        ([f"distributed.shard={tmp_path}/nope.py:shard"], "distributed.shard: no such file"),
    ):
        code, err = main(*_args(data, "bad"), *extra), capfd.readouterr().err  # found before any process starts
        assert code == 2 and err.count("\n") == 1 and says in err, err
    (tmp_path / "lazy.py").write_text("def shard(model, mesh):\n    pass\n")
    args = _args(data, "lazy")
    proc = ddplab(
        args[0], "--nproc-per-node", "2", *args[1:], f"distributed.shard={tmp_path}/lazy.py:shard", cwd=tmp_path
    )
    # found by the workers, once the model is built: the launcher says it once, in one line
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("ddplab: failed: rank 0: ") and "lazy.py:shard sharded nothing" in proc.stderr

    args = [*_args(data, "one"), "training.max_steps=2"]
    assert main(*args) == 0, capfd.readouterr().err[-3000:]  # one process, this one: the snapshot is still DCP
    snap = Checkpointer(tmp_path / "experiments" / "one" / "checkpoints", False).latest()
    capfd.readouterr()
    code, err = main(*_args(data, "other"), "model.dim=16", f"checkpoint.resume={snap}"), capfd.readouterr().err
    assert code == 2 and "tok_emb.weight is (" in err and "this config builds" in err, err


def test_hsdp_needs_whole_nodes_and_a_model_names_its_blocks():
    from ddplab.engine.parallel.distributed import DistContext, LaunchInfo
    from ddplab.engine.parallel.sharding import blocks, shard
    from ddplab.errors import UserError
    from ddplab.models.gpt import GPT, GPTConfig
    from ddplab.registry import load_config

    cfg = load_config(None, ["distributed.strategy=hsdp"])
    ctx = DistContext(LaunchInfo("torchrun", world_size=3, local_world_size=2), "gloo", torch.device("cpu"))
    with pytest.raises(UserError, match="world size 3 must be a multiple of the 2 processes per node"):
        shard(torch.nn.Linear(2, 2), cfg, ctx)
    gpt = GPT(GPTConfig(vocab_size=10, context=8, layers=3, heads=2, dim=8))
    assert blocks(gpt, 10**9) == list(gpt.blocks)  # declared, whatever their size
    mlp = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.ReLU(), torch.nn.Linear(100, 2))
    assert blocks(mlp, 1000) == [mlp[0]]  # a model that declares none: its children of at least 1000 parameters


def test_a_failed_snapshot_write_names_the_path_and_keeps_the_previous_one(tmp_path, data, preempted_at_2):
    import resource

    args = _args(data, "pre")
    shutil.copytree(preempted_at_2, tmp_path, dirs_exist_ok=True)
    ckpts = Path("experiments", "pre", "checkpoints")  # as the run names them: relative to its folder
    proc = subprocess.run(
        command("", args),
        cwd=tmp_path,
        env=_env(),
        text=True,
        capture_output=True,
        timeout=120,  # files over 20 kB cannot be written: a full disk
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000)),
    )
    assert proc.returncode == 1, proc.stderr[-2000:]  # a RunError: a failure at run time, not bad input
    assert f"cannot write snapshot {ckpts}/step-000000004 (OSError: [Errno 27] File too large" in proc.stderr
    assert f"the previous complete snapshot ({ckpts}/step-000000002) is kept" in proc.stderr
    assert [p.name for p in step_snapshots(tmp_path / ckpts)] == ["step-000000002"]
    assert _weights(tmp_path / "experiments" / "pre")  # and it loads


def test_an_fsdp_run_records_its_state_units_and_peak_and_generates(reference, capfd):
    summary = _summary(reference)
    state, units = summary["ddp"]["state_bytes_per_rank"], summary["comm"]["units"]
    whole = 4 * summary["model"]["parameters"]  # float32
    # Rank 0 holds its half of every parameter (a shard a row larger where a dimension is odd), as
    # many gradient bytes, and Adam's two moments of each.
    assert whole / 2 <= state["parameters"] == state["gradients"] < 0.55 * whole
    assert state["optimizer"] >= 2 * state["parameters"]
    # What FSDP gathers as one: the root's own parameters, then each of the 2 blocks.
    assert len(units) == 3 and sum(u["bytes"] for u in units) == whole
    assert all(row["peak_mem_mb"] > 0 for row in summary["epochs"])
    # FSDP's collectives are timed in training (evaluation's gathers left out). Per step: forward gathers the root
    # and 2 blocks, backward the 2 blocks again (the root stays gathered), and 3 reduce-scatters: 8 x 6 steps.
    assert summary["comm"]["timed"] == "all_gather, reduce_scatter"
    assert all(row["comm_calls"] == 48 and 0 < row["comm_time_s"] < row["epoch_time_s"] for row in summary["epochs"])
    assert main("generate", str(reference), "--prompt", "The", "--max-new-tokens", "12") == 0
    text = capfd.readouterr().out
    assert text.startswith("The")


def test_a_model_sharded_as_one_unit_saves_whole_weights_after_a_forward_pass(one_rank_group):
    from torch.distributed.fsdp import fully_shard

    from ddplab.engine.parallel.sharding import full_state, is_sharded

    model = fully_shard(torch.nn.Linear(4, 2))  # the root its only unit, as for a model without blocks
    with torch.no_grad():
        model(torch.randn(3, 4))  # evaluation: FSDP2 leaves the root's parameters gathered, plain tensors
    # What best.pt holds must load into the plain model (`predict`, `generate`): whole tensors, no DTensor.
    assert is_sharded(model) and all(type(v) is torch.Tensor for v in full_state(model).values())


def test_a_user_workload_with_its_own_shard_function_verifies_under_fsdp(tmp_path):
    """Clipping by the global norm over shards and gradient accumulation (no reduce-scatter on the first
    micro-step) give the maths of one process, at verify's stated tolerance."""
    from test_workloads import WORKLOAD, _names, _workload

    wl = _workload(tmp_path, WORKLOAD + SHARD_FIRST_LAYER)
    proc = verify(
        "--nproc",
        "2",
        *_names(wl),
        "distributed.strategy=fsdp",
        f"distributed.shard={wl}:shard",
        "training.max_steps=6",
        "training.batch_size=8",
        "training.grad_accum_steps=2",
        "training.clip_grad_norm=0.05",
        "model.options.dropout=0.0",  # the gradient's norm is about 3
        "training.optimizer=sgd",
        "training.lr=0.5",
        "training.warmup_steps=0",  # Adam would hide a wrong norm
        cwd=tmp_path,
    )
    assert_ok(proc)
    assert proc.stdout.strip().splitlines()[-1] == "PASS", proc.stdout


SHARD_FIRST_LAYER = """

def shard(model, mesh):
    from torch.distributed.fsdp import fully_shard
    fully_shard(model[0], mesh=mesh)  # the root is sharded after it, by ddplab
"""
