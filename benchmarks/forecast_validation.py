"""Validate `ddplab forecast` against measured runs it was not fitted on.

Fit on a small study (1 process at two batch sizes, and 2 processes at two simulated links), then predict the epoch
time of held-out settings: other simulated latencies and bandwidths, another batch size, and a
real bandwidth-limited link between two network namespaces (scripts/netlab/twohost.py, root
only) at two tbf rates. Runs alternate (every setting once per round); prints predicted vs the
measured median epoch time with its range and the relative error, and the load average.

    python benchmarks/forecast_validation.py gpt --repeats 3 --out /tmp/fv-gpt
    python benchmarks/forecast_validation.py cnn --repeats 3 --out /tmp/fv-cnn
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKLOADS = {
    "gpt": [
        "model.name=gpt",
        "data.name=text",
        "model.layers=2",
        "model.dim=64",
        "model.heads=4",
        "model.context=32",
        "data.limit=3000",
    ],
    "cnn": ["model.name=cnn", "data.name=digits"],
}
# The batch of the fitted 2-process runs, a second 1-process batch the compute fit also uses (cost
# per sample falls as the batch grows), and the held-out batch, beyond both.
BATCH = {"gpt": (16, 32, 48), "cnn": (32, 64, 96)}
COMMON = [
    "training.epochs=1",
    "logging.trackers=[]",
    "logging.progress=false",
    "checkpoint.save_best=false",
    "generate.max_new_tokens=0",
    "logging.log_every=50",
    "training.warmup_steps=0",
]


def settings(workload: str, netns: bool) -> list[dict]:
    """name, processes, nodes, batch, overrides, tbf rate, whether the fit uses it."""
    b, b1, b2 = BATCH[workload]
    rows = [
        dict(name="n1", procs=1, b=b, fit=True),
        dict(name=f"n1-batch{b1}", procs=1, b=b1, fit=True),
        dict(name="n2-lat0", procs=2, b=b, fit=True),
        dict(name="n2-lat5ms", procs=2, b=b, lat=5.0, fit=True),
        dict(name="n2-lat20ms", procs=2, b=b, lat=20.0),
        dict(name="n2-bw100Mbit", procs=2, b=b, bw=100.0),
        dict(name="n2-lat2ms-bw400Mbit", procs=2, b=b, lat=2.0, bw=400.0),
        dict(name=f"n1-batch{b2}", procs=1, b=b2),
        dict(name=f"n2-batch{b2}", procs=2, b=b2),
    ]
    if netns:
        rows += [
            dict(name="netns-50mbit", procs=2, nodes=2, b=b, rate="50mbit"),
            dict(name="netns-200mbit", procs=2, nodes=2, b=b, rate="200mbit"),
        ]
    return rows


def _twohost():
    spec = importlib.util.spec_from_file_location("twohost", ROOT / "scripts" / "netlab" / "twohost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_one(workload: str, s: dict, folder: Path, log) -> None:
    args = [
        "train",
        *WORKLOADS[workload],
        *COMMON,
        f"training.batch_size={s['b']}",
        f"experiment.output_dir={folder.parent}",
        f"experiment.name={folder.name}",
        f"distributed.simulated_latency_ms={s.get('lat', 0.0)}",
    ]
    if s.get("bw"):
        args.append(f"distributed.simulated_bandwidth_mbps={s['bw']}")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if s.get("rate"):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "study_point.json").write_text(
            json.dumps({"point": folder.name, "nodes": 2, "per_node": 1, "processes": 2, "setup": "2x1", "swept": {}})
        )
        with _twohost().TwoHosts(s["rate"]) as hosts:
            code = hosts.run(args, 1, timeout=600, log=log)
    elif s["procs"] == 1:
        code = subprocess.call([sys.executable, "-m", "ddplab", *args], env=env, stdout=log, stderr=subprocess.STDOUT)
    else:
        code = subprocess.call(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={s['procs']}",
                "-m",
                "ddplab",
                *args,
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    if code != 0:
        raise SystemExit(f"run {folder} failed (exit {code}); see {log.name}")


def measured(folder: Path):
    from ddplab.forecast.model import measure
    from ddplab.report.runs import find_runs

    runs, _ = find_runs([folder])
    return measure(runs[0])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workload", choices=list(WORKLOADS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="experiments/forecast-validation")
    p.add_argument("--no-netns", action="store_true", help="leave out the two-namespace rows")
    ns = p.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from ddplab.config import batch_arithmetic
    from ddplab.forecast.fit import comm_of, fit_link
    from ddplab.forecast.links import Link, parse_bandwidth
    from ddplab.forecast.model import fit_compute, predict_step

    out = Path(ns.out) / ns.workload
    out.mkdir(parents=True, exist_ok=True)
    why = None if not ns.no_netns else "--no-netns"
    if why is None:
        why = _twohost().available()
    grid = settings(ns.workload, netns=why is None)
    load_before = os.getloadavg()
    start = time.time()
    ran = False
    with open(out / "runs.log", "a") as log:
        for rep in range(ns.repeats):  # alternate: every setting once per round
            for s in grid:
                folder = out / f"{s['name']}-r{rep}"
                if (
                    not (folder / "metrics.json").is_file()
                    or json.loads((folder / "metrics.json").read_text()).get("status") != "complete"
                ):
                    print(f"round {rep + 1}/{ns.repeats}: {s['name']}", file=sys.stderr, flush=True)
                    run_one(ns.workload, s, folder, log)
                    ran = True
    # A second call only re-reads the runs: keep the load and time of the call that made them.
    record = out / "load.json"
    if ran or not record.is_file():
        record.write_text(json.dumps({"before": load_before, "after": os.getloadavg(), "seconds": time.time() - start}))
    loads = json.loads(record.read_text())
    load_before, load_after, seconds = loads["before"], loads["after"], loads["seconds"]
    points = {s["name"]: [measured(out / f"{s['name']}-r{rep}") for rep in range(ns.repeats)] for s in grid}

    # The fit: compute from the 1-process runs, link and compute scale from the 2-process ones.
    fit_rows = [s for s in grid if s.get("fit")]
    compute = fit_compute([m for s in fit_rows if s["procs"] == 1 for m in points[s["name"]]])
    fit = fit_link(compute, [m for s in fit_rows if s["procs"] > 1 for m in points[s["name"]]])
    ref = points["n2-lat0"][0]
    comm = comm_of(ref)

    lines = [
        f"# Forecast validation: {ns.workload}",
        "",
        f"fit on {', '.join(s['name'] for s in fit_rows)}: {fit.link.describe()}, compute scale "
        f"{fit.compute_scale:.2f}; fit residual rms {fit.rms_rel:.1%} (worst {fit.max_rel:.1%})",
        f"{ns.repeats} alternating repeats per setting; load average before {load_before[0]:.2f} "
        f"{load_before[1]:.2f} {load_before[2]:.2f}, after {load_after[0]:.2f} {load_after[1]:.2f} "
        f"{load_after[2]:.2f}; {seconds:.0f} s of runs" + ("" if why is None else f"; netns rows left out: {why}"),
        "",
        "| setting | fitted on | predicted epoch (s) | measured median (s) | measured range (s) | error |",
        "|---|---|---|---|---|---|",
    ]
    errors = []
    for s in grid:
        ms = points[s["name"]]
        nodes = s.get("nodes", 1)
        inter = fit.link
        if s.get("rate"):
            # The veth pair carries what the fitted link carried (gloo's copies and sums on these
            # CPUs) and then the tbf wire: their per-byte costs add.
            inter = Link(fit.link.alpha, 1 / (1 / fit.link.bandwidth + 1 / parse_bandwidth(s["rate"])))
        step = predict_step(
            compute,
            comm,
            nodes,
            s["procs"] // nodes,
            s["b"],
            inter,
            fit.link,
            ms[0].accum,
            fit.compute_scale,
            s.get("lat", 0.0),
            s.get("bw"),
        )
        predicted = (
            step.step_s * batch_arithmetic(s["b"], ms[0].accum, s["procs"], ms[0].train_samples)["steps_per_epoch"]
        )
        epochs = [m.epoch_s for m in ms]
        median = statistics.median(epochs)
        err = predicted / median - 1
        if not s.get("fit"):
            errors.append(abs(err))
        lines.append(
            f"| {s['name']} | {'yes' if s.get('fit') else 'no'} | {predicted:.2f} | {median:.2f} | "
            f"{min(epochs):.2f}-{max(epochs):.2f} | {err:+.1%} |"
        )
    lines += [
        "",
        f"held-out settings: median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%} "
        f"(goal: median <= 15 %, worst <= 30 %)",
    ]
    text = "\n".join(lines) + "\n"
    (out / "validation.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
