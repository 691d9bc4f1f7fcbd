"""`ddplab report`: arithmetic of the table from run folders written by hand, and bad input."""

import csv
import json

import pytest

from conftest import main
from ddplab.errors import UserError
from ddplab.report.build import make_report
from ddplab.report.runs import find_runs
from ddplab.report.table import HEAD, TIMING_COLUMNS, build_rows, epochs_within, markdown_table


def _run_folder(root, name, world, rate, *, batch=8, lr=1e-3, status="complete", epoch_time=10.0, test=None):
    folder = root / name
    folder.mkdir(parents=True)
    epochs = [
        {
            "epoch": e,
            "step": 10 * e,
            "train_loss": 2.0 / e,
            "val_loss": 2.1 / e,
            "val_accuracy": 0.3 * e,
            "epoch_time_s": epoch_time,
            "elapsed_s": epoch_time * e,
            "samples_per_s": rate,
            "comm_time_s": 0.5 if world > 1 else 0.0,
            "compute_time_s": epoch_time - (0.5 if world > 1 else 0.0),
        }
        for e in (1, 2, 3)
    ]
    steps = [{"step": s, "loss": 2.0, "lr": lr, "elapsed_s": epoch_time * s / 10} for s in range(5, 31, 5)]
    summary = {
        "status": status,
        "config": {"training": {"batch_size": batch, "lr": lr}, "experiment": {"name": name}},
        "ddp": {
            "world_size": world,
            "per_process": batch,
            "global": batch * world,
            "steps_per_epoch": 10,
            "lr": lr,
            "grad_accum_steps": 1,
        },
        "epochs": epochs,
        "steps": steps,
        "test": test or {},
        "aggregates": {"steps": 30, "train_time_s": 3 * epoch_time, "best_val_loss": 0.7},
    }
    (folder / "metrics.json").write_text(json.dumps(summary))
    return folder


def test_speedup_and_efficiency_against_the_one_process_run_of_the_same_experiment(tmp_path):
    _run_folder(tmp_path, "a1", 1, 100.0)
    _run_folder(tmp_path, "a4", 4, 300.0, epoch_time=4.0, test={"loss": 0.5, "accuracy": 0.875})
    _run_folder(tmp_path, "b1", 1, 400.0, batch=32)
    _run_folder(tmp_path, "b2", 2, 600.0, batch=32)
    _run_folder(tmp_path, "c2", 2, 150.0, lr=5e-3)  # no 1-process run with this lr: no speedup
    _run_folder(tmp_path, "late", 2, 1.0, status="running")
    runs, unfinished = find_runs([tmp_path])
    assert [u.name for u in unfinished] == ["late"]
    rows = {r["point"]: r for r in build_rows(runs, budget_s=12.0)}
    assert rows["a4"]["speedup"] == pytest.approx(3.0) and rows["a4"]["efficiency"] == pytest.approx(0.75)
    assert rows["b2"]["speedup"] == pytest.approx(1.5) and rows["b2"]["efficiency"] == pytest.approx(0.75)
    assert rows["a1"]["speedup"] == pytest.approx(1.0) and rows["b2"]["baseline"] == "b1"
    assert rows["c2"]["speedup"] is None and rows["c2"]["efficiency"] is None
    assert rows["a4"]["global_batch"] == 32 and rows["a4"]["mean_epoch_time_s"] == pytest.approx(4.0)
    assert rows["a4"]["comm_ms_per_step"] == pytest.approx(1000 * 1.5 / 30)
    # 12 s of training: a1 (10 s epochs) reached step 10 at 10 s; a4 (4 s epochs) step 30 at 12 s.
    assert rows["a1"]["epochs_at_budget"] == pytest.approx(1.0) and rows["a4"]["epochs_at_budget"] == pytest.approx(3.0)


def test_epochs_within_budget_uses_the_step_log(tmp_path):
    runs, _ = find_runs([_run_folder(tmp_path, "r", 1, 100.0)])
    assert epochs_within(runs[0], 15.0) == pytest.approx(1.5)  # step 15 logged at 15 s
    assert epochs_within(runs[0], 0.1) == 0


def test_report_files(tmp_path):
    _run_folder(tmp_path / "runs", "a1", 1, 100.0)
    _run_folder(tmp_path / "runs", "a2", 2, 180.0, test={"loss": 0.5, "accuracy": 0.9})
    md = make_report([tmp_path / "runs"], tmp_path / "out", budget_s=25.0)
    text = md.read_text()
    assert "| a2 |" in text and "| 1.80 | 0.90 |" in text and "90.00%" in text
    assert "within 25.0 s" in text and "Memory and cost per strategy" not in text  # DDP only
    rows = list(csv.DictReader(open(tmp_path / "out" / "report.csv")))
    assert [r["point"] for r in rows] == ["a1", "a2"] and float(rows[1]["efficiency"]) == pytest.approx(0.9)
    for png in ("epoch_time", "scaling", "loss_epochs", "loss_time", "accuracy_time", "comm"):
        assert (tmp_path / "out" / f"{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_finished_runs_is_a_user_error(tmp_path, monkeypatch, capfd):
    with pytest.raises(UserError, match="no finished run folders"):
        find_runs([tmp_path])
    monkeypatch.chdir(tmp_path)
    code, err = main("report", str(tmp_path / "missing")), capfd.readouterr().err
    assert code == 2 and "missing" in err and len(err.strip().splitlines()) == 1
    code, err = main("report", str(tmp_path), "--budget", "soon"), capfd.readouterr().err
    assert code == 2 and "--budget" in err


def _point(root, name, setup, rate, *, repeat=1, batch=8, epoch_time=None, test=None, budget=None):
    """A study point's run folder: metrics.json and its study_point.json."""
    nodes, per_node = (int(x) for x in setup.split("x"))
    run = name if repeat == 1 else f"{name}-r{repeat}"
    world = nodes * per_node
    folder = _run_folder(root, run, world, rate, batch=batch, epoch_time=epoch_time or 1000.0 * batch / rate, test=test)
    if budget:
        summary = json.loads((folder / "metrics.json").read_text())
        summary["aggregates"]["time_budget_s"] = budget
        (folder / "metrics.json").write_text(json.dumps(summary))
    (folder / "study_point.json").write_text(
        json.dumps(
            {
                "study": "s",
                "point": name,
                "run": run,
                "repeat": repeat,
                "nodes": nodes,
                "per_node": per_node,
                "processes": world,
                "setup": setup,
                "swept": {"training.batch_size": str(batch)},
            }
        )
    )
    return folder


def test_repeats_fold_into_median_and_range_and_overlap_is_called_noise(tmp_path):
    for r, rate in enumerate([100.0, 120.0, 110.0], 1):
        _point(tmp_path, "n1", "1x1", rate, repeat=r)
    for r, rate in enumerate([200.0, 230.0, 180.0], 1):
        _point(tmp_path, "n2", "1x2", rate, repeat=r)
    for r, rate in enumerate([190.0, 240.0, 215.0], 1):
        _point(tmp_path, "n2x1", "2x1", rate, repeat=r)
    runs, _ = find_runs([tmp_path])
    rows = {r["setup"]: r for r in build_rows(runs, None)}
    assert set(rows) == {"1x1", "1x2", "2x1"} and all(r["repeats"] == 3 for r in rows.values())
    one = rows["1x1"]
    assert (one["samples_per_s"], one["samples_per_s_min"], one["samples_per_s_max"]) == (110.0, 100.0, 120.0)
    # each repeat's speedup is against the baseline's median, then folded the same way
    two = rows["1x2"]
    assert (two["speedup"], two["speedup_min"], two["speedup_max"]) == pytest.approx((200 / 110, 180 / 110, 230 / 110))
    assert two["efficiency"] == pytest.approx(200 / 110 / 2)
    assert one["mean_epoch_time_s"] == pytest.approx(1000 * 8 / 110) and one["epochs_at_budget"] is None

    md = make_report([tmp_path], tmp_path / "out").read_text()
    assert "| 1x2 | 8 | 2 |" in md and "| 200.0 (180.0–230.0) |" in md and "| 110.0 (100.0–120.0) |" in md
    assert (
        "1x1 batch_size=8 110.0 (100.0–120.0) vs 1x2 batch_size=8 200.0 (180.0–230.0): 1x2 batch_size=8 is 1.82x" in md
    )
    assert "1x2 batch_size=8 200.0 (180.0–230.0) vs 2x1 batch_size=8 215.0 (190.0–240.0): **within noise**" in md
    assert "epochs @ budget**: — (no budget: pass --budget" in md
    rows_csv = {r["setup"]: r for r in csv.DictReader(open(tmp_path / "out" / "report.csv"))}
    assert rows_csv["2x1"]["repeats"] == "3" and float(rows_csv["2x1"]["samples_per_s_max"]) == 240.0


def test_setups_are_categories_in_the_plots(tmp_path, monkeypatch):
    """1x2 and 2x1 have the same process count: two x positions, labelled by setup, never merged."""
    from ddplab.report import plots

    _point(tmp_path, "n1", "1x1", 100.0)
    _point(tmp_path, "n2", "1x2", 190.0)
    _point(tmp_path, "n2x1", "2x1", 150.0)
    _point(tmp_path, "n1-32", "1x1", 300.0, batch=32)
    _point(tmp_path, "n2-32", "1x2", 500.0, batch=32)
    _point(tmp_path, "n2x1-32", "2x1", 450.0, batch=32)
    runs, _ = find_runs([tmp_path])
    rows = build_rows(runs, None)
    seen = {}

    def keep(fig, path):
        ax = fig.axes[0]
        seen[path.name] = (
            [t.get_text() for t in ax.get_xticklabels()],
            {c.get_label(): [float(x) for x in c.lines[0].get_xdata()] for c in ax.containers},
            ax.get_xlabel(),
        )
        return path

    monkeypatch.setattr(plots, "save_png", keep)
    plots.setups_plots(rows, tmp_path)
    plots.sweep_plots(rows, tmp_path)
    ticks, lines, xlabel = seen["epoch_time.png"]
    assert ticks == ["1x1", "1x2", "2x1"] and xlabel.startswith("setup")
    assert lines == {"batch_size=8": [0, 1, 2], "batch_size=32": [0, 1, 2]}
    ticks, lines, xlabel = seen["vs_batch_size.png"]  # one line per setup against the swept value
    assert ticks == ["8", "32"] and xlabel == "training.batch_size"
    assert lines == {"1x1": [8.0, 32.0], "1x2": [8.0, 32.0], "2x1": [8.0, 32.0]}


def test_scaling_table_has_the_reference_layout(tmp_path):
    """Seed 004's table: a column per setup; rows lr, global batch, steps/epoch, epoch time,
    epochs at the budget, efficiency against the smallest setup, best val loss, test loss, top-1."""
    _point(tmp_path, "n1", "1x1", 100.0, test={"loss": 0.45, "accuracy": 0.869}, budget=400.0)
    _point(tmp_path, "n2", "1x2", 160.0, test={"loss": 0.43, "accuracy": 0.873}, budget=400.0)
    _point(tmp_path, "n4", "2x2", 260.0, test={"loss": 0.42, "accuracy": 0.875}, budget=400.0)
    text = make_report([tmp_path], tmp_path / "out").read_text()
    table = text[text.index("### Scaling table") :].splitlines()
    assert table[2] == "| | 1x1 | 1x2 | 2x2 |"
    names = [line.split("|")[1].strip(" *") for line in table[4:13]]
    assert names == [
        "Learning rate",
        "Global batch size",
        "Steps per epoch",
        "Avg epoch time (s)",
        "Epochs @ budget",
        "Scaling efficiency",
        "Best validation loss",
        "Test loss",
        "Top-1 test accuracy",
    ]
    cells = {n: [c.strip() for c in line.split("|")[2:-1]] for n, line in zip(names, table[4:13], strict=True)}
    assert cells["Global batch size"] == ["8", "16", "32"]
    assert cells["Scaling efficiency"] == ["1.00", f"{160 / 100 / 2:.2f}", f"{260 / 100 / 4:.2f}"]
    assert cells["Top-1 test accuracy"] == ["86.90%", "87.30%", "87.50%"]
    # 400 s, the runs' own training.time_budget, is longer than any of them trained (3 epochs): projected
    assert cells["Epochs @ budget"] == [f"≈{400 / (1000 * 8 / r):.2f}" for r in (100.0, 160.0, 260.0)]
    assert "the runs' training.time_budget" in text


def test_epochs_at_budget_is_measured_within_the_budget_or_says_why_not(tmp_path):
    _point(tmp_path, "n1", "1x1", 100.0)  # 80 s epochs, 240 s in all
    runs, _ = find_runs([tmp_path])
    assert build_rows(runs, 100.0)[0]["epochs_at_budget"] == pytest.approx(1.0)  # step 10 logged at 80 s
    text = make_report([tmp_path], tmp_path / "o").read_text()
    assert "— (no budget: pass --budget" in text and "shortest" not in text


def test_a_strategy_sweep_shows_memory_per_rank_peak_step_and_overhead(tmp_path):
    # (strategy, processes, parameter / gradient / optimizer MiB per rank, peak MiB, epoch s of 10 steps)
    for strategy, world, state, peak, epoch_time in (
        ("ddp", 1, (4, 4, 8), 500, 10.0),
        ("ddp", 2, (4, 4, 8), 600, 12.0),
        ("fsdp", 1, (4, 4, 8), 500, 10.0),
        ("fsdp", 2, (2, 2, 4), 450, 13.0),
    ):
        folder = _point(tmp_path, f"{strategy}-n{world}", f"1x{world}", 100.0 * world, epoch_time=epoch_time)
        summary = json.loads((folder / "metrics.json").read_text())
        summary["config"]["distributed"] = {"strategy": strategy}  # its own experiment, with its own 1-process point
        summary["ddp"] |= {
            "strategy": strategy,
            "state_bytes_per_rank": dict(
                zip(("parameters", "gradients", "optimizer"), (mib * 2**20 for mib in state), strict=True)
            ),
        }
        summary["comm"] = {"timed": "all_reduce" if strategy == "ddp" else "all_gather, reduce_scatter"}
        for row in summary["epochs"]:
            row["peak_mem_mb"] = peak + row["epoch"]  # the largest epoch's counts
        (folder / "metrics.json").write_text(json.dumps(summary))
        point = json.loads((folder / "study_point.json").read_text())
        (folder / "study_point.json").write_text(json.dumps(point | {"swept": {"distributed.strategy": strategy}}))
    runs, _ = find_runs([tmp_path])
    rows = {r["point"]: r for r in build_rows(runs, None)}
    fsdp, ddp = rows["fsdp-n2"], rows["ddp-n2"]
    assert (fsdp["params_mb"], fsdp["grads_mb"], fsdp["optim_mb"], fsdp["peak_mem_mb"]) == (2, 2, 4, 453)
    # Step: 13 s / 10 steps; overhead over fsdp's own 1-process point (10 s / 10 steps): 300 ms.
    assert fsdp["step_ms"] == pytest.approx(1300) and fsdp["overhead_ms_per_step"] == pytest.approx(300)
    assert ddp["overhead_ms_per_step"] == pytest.approx(200) and rows["ddp-n1"]["overhead_ms_per_step"] == 0
    # Each timed its collectives (1.5 s over 30 steps): DDP's all-reduce, FSDP's gathers and reduce-scatters.
    assert ddp["comm_ms_per_step"] == pytest.approx(50) and fsdp["comm_ms_per_step"] == pytest.approx(50)
    md = make_report([tmp_path], tmp_path / "out").read_text()
    timing, memory = md.split("## Memory and cost per strategy")
    assert "| point | setup (nodes x procs) | strategy | processes |" in timing  # the swept strategy as a column
    assert "| fsdp-n2 | 1x2 | fsdp | 2 | 2 | 4 | 453 | 200.0 | 1,300.0 | 50.0 | 300.0 |" in memory
    assert "| ddp-n2 | 1x2 | ddp | 4 | 4 | 8 | 603 | 200.0 | 1,200.0 | 50.0 | 200.0 |" in memory
    # A run cut by max_steps inside its first epoch has no full epoch; its step time comes from the partial one.
    summary = json.loads((tmp_path / "ddp-n2" / "metrics.json").read_text())
    summary["epochs"] = [summary["epochs"][0] | {"partial": True, "epoch_time_s": 3.0}]
    summary["aggregates"]["steps"] = 4
    (tmp_path / "ddp-n2" / "metrics.json").write_text(json.dumps(summary))
    assert {r["point"]: r for r in build_rows(find_runs([tmp_path])[0], None)}["ddp-n2"]["step_ms"] == 750
    # A sharded run that timed nothing (its rows' 0 is no measurement) shows no communication time.
    summary = json.loads((tmp_path / "fsdp-n2" / "metrics.json").read_text())
    (tmp_path / "fsdp-n2" / "metrics.json").write_text(json.dumps(summary | {"comm": {}}))
    assert {r["point"]: r for r in build_rows(find_runs([tmp_path])[0], None)}["fsdp-n2"]["comm_ms_per_step"] is None


def _replica_group_folder(root, name, epochs):
    """Group 0 of a 2-group job (2 x 1 process, 32 samples per process) as the engine writes it: epoch rows
    with the columns engine.replicas adds, in metrics.json and metrics.csv. `epochs`: each one's steps, as
    (groups in the quorum, global batch) per committed step."""
    from ddplab.config import batch_arithmetic
    from ddplab.engine.parallel.replicas import Replicas
    from ddplab.engine.run_folder.folder import RunFolder
    from ddplab.registry import load_config

    cfg = load_config(
        None,
        [
            "distributed.fault_tolerance=replicas",
            "distributed.replica_groups=2",
            "distributed.lighthouse=http://lighthouse:29510",
            f"experiment.name={name}",
        ],
    )
    tally = Replicas.__new__(Replicas)  # its epoch tally only: no quorum, no torchft manager
    tally.groups = 2
    rows, step = [], 0
    for epoch, steps in enumerate(epochs, 1):
        tally.load_state_dict({"epoch": [batch for _, batch in steps], "fewest": min(groups for groups, _ in steps)})
        step += len(steps)
        row = {"epoch": epoch, "step": step, "train_loss": 2.0 / epoch, "val_loss": 2.1 / epoch}
        row |= {"epoch_time_s": 5.0, "elapsed_s": 5.0 * epoch, "samples_per_s": 100.0, "lr": 1e-3}
        rows.append({**row, **tally.epoch_columns()})
    run = RunFolder(root / cfg.run_name(), is_main=True)
    run.write_epochs(rows)
    batch = batch_arithmetic(32, 1, 2, 640)  # world size x groups: the shares the data is split in
    run.write_json(
        "metrics.json",
        {
            "status": "complete",
            "config": cfg.to_dict(),
            "ddp": {**batch, "lr": 1e-3, "lr_scaling": "none", "strategy": "ddp"},
            "epochs": rows,
            "steps": [],
            "aggregates": {"steps": step, "train_time_s": 5.0 * len(epochs), "best_val_loss": 0.7},
            "test": {},
        },
    )
    run.close()
    return run.path


def test_a_replica_group_run_reports_the_global_batch_it_made_and_the_groups_present(tmp_path):
    both, alone = (2, 64), (1, 32)
    folder = _replica_group_folder(
        tmp_path / "runs",
        "r",
        [[both] * 10, [both] * 6 + [alone] * 4, [both] * 5],  # group 1 away 4 steps
    )
    with open(folder / "metrics.csv") as f:
        made = [(int(r["replicas"]), float(r["global_batch"])) for r in csv.DictReader(f)]
    assert made == [(2, 64.0), (1, 51.2), (2, 64.0)]
    _run_folder(tmp_path / "runs", "plain", 2, 100.0)
    runs, _ = find_runs([tmp_path / "runs"])
    rows = {r["point"]: r for r in build_rows(runs, None)}
    group = rows["r-group0"]
    assert group["global_batch"] == pytest.approx((10 * 64 + 6 * 64 + 4 * 32 + 5 * 64) / 25)  # mean per step
    assert (group["global_batch_planned"], group["replicas_min"], group["replicas_max"]) == (64, 1, 2)
    table = markdown_table(list(rows.values()))
    head, _, *lines = table.splitlines()
    assert "| global batch | replica groups |" in head
    assert "| 58.9 of 64 | 1–2 of 2 |" in next(line for line in lines if "r-group0" in line)
    assert "| 16 | — |" in next(line for line in lines if "plain" in line)
    text = make_report([tmp_path / "runs"], tmp_path / "out").read_text()
    assert "**global batch** of a replica-group run" in text and "| 58.9 of 64 | 1–2 of 2 |" in text
    with open(tmp_path / "out" / "report.csv") as f:
        written = {r["point"]: r for r in csv.DictReader(f)}
    assert float(written["r-group0"]["global_batch"]) == pytest.approx(58.88) and written["plain"]["replicas_min"] == ""


def test_a_report_without_replica_groups_is_unchanged(tmp_path):
    _run_folder(tmp_path, "a1", 1, 100.0)
    _run_folder(tmp_path, "a2", 2, 180.0)
    rows = build_rows(find_runs([tmp_path])[0], None)
    head, _, _, a2 = markdown_table(rows).splitlines()
    assert head == "| " + " | ".join(h for _, h in HEAD + TIMING_COLUMNS) + " |" and "| 2 | 8 | 16 | 0.001 |" in a2
    assert not any(k.startswith("replica") or k == "global_batch_planned" for r in rows for k in r)
