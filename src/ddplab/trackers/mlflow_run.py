"""MLflow: one run per run folder (a study point's is a child of its study's run)."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path

from ddplab.engine.run_folder.files import read_json, write_atomic
from ddplab.engine.run_folder.folder import RunFolder
from ddplab.engine.snapshots.fingerprint import flatten
from ddplab.runtime import process_state
from ddplab.trackers.base import Tracker


def mlflow_uri(configured: str | None, run_dir: Path, study: dict | None) -> str:
    """logging.mlflow_uri (`configured`), else $MLFLOW_TRACKING_URI, else mlflow/ beside the run folder (a
    point's: its study's)."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    store = (run_dir.parent.parent if study else run_dir.parent).resolve() / "mlflow"
    store.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{store / 'mlflow.db'}"


def _key(name: str) -> str:
    return re.sub(r"[^\w\-./ ]", "_", name)


class MLflow(Tracker):
    """One MLflow run per run folder: params, tags, metrics by step, config.yaml and metrics.csv."""

    name = "mlflow"

    def start(self, view, record, study):
        from mlflow.entities import Param, RunTag  # the track extra; only when mlflow is a tracker
        from mlflow.tracking import MlflowClient

        # A server that is down should cost seconds, not MLflow's default minutes of retries.
        process_state.env_default("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        process_state.env_default("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        # Quiet: "Creating initial MLflow database tables".
        process_state.logger_level("mlflow.store.db.utils", logging.WARNING)
        cfg, run_dir = view.config, view.run.path
        uri = mlflow_uri(cfg.logging.mlflow_uri, run_dir, study)
        self.client = client = MlflowClient(tracking_uri=uri)
        mine, params = record.get(self.name, {}), []
        env = flatten(read_json(run_dir / RunFolder.ENV))
        tags = [RunTag(_key(f"env.{k}"), str(v)[:500]) for k, v in env.items() if k != "ranks" and v is not None]
        if mine.get("uri") == uri:
            self.run_id = mine["run_id"]
            client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = _experiment(client, cfg.logging.mlflow_experiment, uri)
            tags.append(RunTag("ddplab.run_folder", str(run_dir.resolve())))
            if study:
                tags += [
                    RunTag("mlflow.parentRunId", _parent(client, experiment, uri, run_dir.parent, study)),
                    *(RunTag(k, str(study[k])) for k in ("study", "point", "setup", "repeat", "processes")),
                    *(RunTag(_key(k), str(v)) for k, v in study.get("swept", {}).items()),
                ]
            self.run_id = client.create_run(experiment, run_name=cfg.run_name()).info.run_id
            params = [Param(_key(k), str(v)[:6000]) for k, v in flatten(cfg.to_dict()).items()]
            record[self.name] = {"uri": uri, "run_id": self.run_id}
        for i in range(0, max(len(params), len(tags)), 100):  # MLflow's limit per batch, for each
            client.log_batch(self.run_id, params=params[i : i + 100], tags=tags[i : i + 100])
        return self._last_step("train/loss"), self._last_step("epoch")

    def _last_step(self, key: str) -> int:
        return max((m.step for m in self.client.get_metric_history(self.run_id, key)), default=0)

    def log(self, values, step):
        from mlflow.entities import Metric  # the track extra; only when mlflow is a tracker

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(_key(k), v, now, step) for k, v in values.items()])

    def finish(self, view, status):
        for name in (RunFolder.CONFIG, RunFolder.METRICS_CSV):
            if (view.run.path / name).is_file():
                self.client.log_artifact(self.run_id, str(view.run.path / name))
        ended = {"complete": "FINISHED", "preempted": "KILLED", "interrupted": "KILLED"}
        self.client.set_terminated(self.run_id, ended.get(status, "FAILED"))


def _experiment(client, name: str, uri: str) -> str:
    """The experiment's id; a new one in the local store keeps its artifacts beside the database."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    local = uri.startswith("sqlite:///")
    where = (Path(uri.removeprefix("sqlite:///")).parent / "artifacts").as_uri() if local else None
    return client.create_experiment(name, artifact_location=where)


def _parent(client, experiment: str, uri: str, study_dir: Path, study: dict) -> str:
    """The study's MLflow run: made by its first point, its id kept in the study folder."""
    path = study_dir / RunFolder.TRACKERS
    record = read_json(path)
    if record.get("mlflow", {}).get("uri") != uri:
        run = client.create_run(
            experiment, run_name=study["study"], tags={"ddplab.study_folder": str(study_dir.resolve())}
        )
        record["mlflow"] = {"uri": uri, "run_id": run.info.run_id}
        write_atomic(study_dir, RunFolder.TRACKERS, json.dumps(record, indent=2) + "\n")
    return record["mlflow"]["run_id"]


def finish_study(study_dir: Path, report_dir: Path) -> None:
    """After `ddplab study`: the report's tables and plots on the study's MLflow run, which then ends."""
    record = read_json(Path(study_dir) / RunFolder.TRACKERS).get("mlflow")
    if not record:
        return
    try:
        from mlflow.tracking import MlflowClient  # the track extra; only when mlflow is a tracker

        client = MlflowClient(tracking_uri=record["uri"])
        for path in sorted(Path(report_dir).iterdir()):
            if path.suffix in (".md", ".csv", ".png"):
                client.log_artifact(record["run_id"], str(path), "report")
        client.set_terminated(record["run_id"], "FINISHED")
    except Exception as exc:  # noqa: BLE001 - the report is written; the tracker is extra
        print(f"WARNING: the study's MLflow run did not get the report: {type(exc).__name__}: {exc}")
