"""The two-host test bed: two network namespaces joined by a tbf-limited veth pair (root only)."""

import importlib.util
import subprocess

import pytest

from conftest import ROOT, TINY_GPT

_spec = importlib.util.spec_from_file_location("twohost", ROOT / "scripts" / "netlab" / "twohost.py")
twohost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(twohost)

_WHY = twohost.available()
needs_netns = pytest.mark.skipif(_WHY is not None, reason=f"two-host test bed: {_WHY}")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@needs_netns
def test_namespaces_made_limited_and_removed_also_on_failure():
    hosts = twohost.TwoHosts(rate="20mbit")
    with pytest.raises(RuntimeError, match="boom"):
        with hosts:
            assert set(hosts.namespaces) <= _namespaces()
            qdisc = subprocess.run(
                ["tc", "-n", hosts.namespaces[0], "qdisc", "show", "dev", hosts.devices[0]],
                capture_output=True,
                text=True,
            ).stdout
            assert "tbf" in qdisc and "20Mbit" in qdisc
            addr = subprocess.run(
                ["ip", "-n", hosts.namespaces[1], "addr", "show", hosts.devices[1]], capture_output=True, text=True
            ).stdout
            assert f"{twohost.SUBNET}.2/24" in addr
            raise RuntimeError("boom")
    assert not set(hosts.namespaces) & _namespaces()
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert hosts.devices[0] not in links


@needs_netns
def test_tiny_training_run_across_the_two_namespaces(tmp_path, corpus):
    args = [
        "train",
        f"data.path={corpus}",
        *TINY_GPT,
        "training.max_steps=4",
        "data.limit=200",
        f"experiment.output_dir={tmp_path}",
        "experiment.name=twohost",
        "checkpoint.save_best=false",
        "generate.max_new_tokens=0",
    ]
    with open(tmp_path / "log.txt", "w") as log:
        with twohost.TwoHosts(rate="200mbit") as hosts:
            code = hosts.run(args, 1, timeout=120, log=log)
    text = (tmp_path / "log.txt").read_text()
    assert code == 0, text[-3000:]
    assert "world size 2" in text
    assert (tmp_path / "twohost" / "metrics.json").is_file()
    assert not set(hosts.namespaces) & _namespaces()
