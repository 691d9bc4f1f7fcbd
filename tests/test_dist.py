"""The package as a user gets it: the wheel `make dist` builds, installed into a fresh environment that already
holds torch (here: the suite's own, through a .pth file, as a cluster's module or a container provides one),
trains the embedded default."""

from __future__ import annotations

import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

import ddplab
from conftest import ROOT, _env, assert_ok


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`python -m build` of a copy of this tree (a build writes into the tree it builds; without build isolation:
    the suite's setuptools, no download), its wheel checked by twine as `make dist` checks it."""
    out, tree = tmp_path_factory.mktemp("dist"), tmp_path_factory.mktemp("tree") / "ddplab"
    skip = (".*", "experiments", "build", "dist", "site", "*.egg-info", "__pycache__")
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(*skip))
    build = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(tree)]
    assert_ok(subprocess.run(build, capture_output=True, text=True, timeout=300))
    (found,) = out.glob("ddplab-*.whl")
    assert_ok(
        subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(found)], capture_output=True, text=True)
    )
    return found


def test_the_wheel_installs_beside_an_existing_torch_and_trains(tmp_path, wheel):
    assert wheel.name == f"ddplab-{ddplab.__version__}-py3-none-any.whl"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], capture_output=True, text=True
    ).stdout.strip()
    # The suite's packages after the fresh environment's own: torch is found there, and its editable ddplab is
    # not (a path a .pth file adds is not a site folder: the .pth files inside it are not run).
    Path(purelib, "torch-beside.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    # --no-index: every dependency must be met by what is there already; torch is neither downloaded nor replaced.
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index", str(wheel)]
    p = subprocess.run(install, capture_output=True, text=True, timeout=300)
    print(p.stdout[-1500:], p.stderr[-1500:])
    env = {k: v for k, v in _env().items() if k != "PYTHONPATH"}
    ddplab_bin = venv / "bin" / "ddplab"
    version = subprocess.run([ddplab_bin, "--version"], capture_output=True, text=True, env=env)
    assert version.stdout.strip() == f"ddplab {ddplab.__version__}"
    where = subprocess.run(
        [python, "-c", "import ddplab; print(ddplab.__file__)"], capture_output=True, text=True, env=env
    )
    assert where.stdout.startswith(purelib), where  # the wheel's copy, not this tree's
    train = [ddplab_bin, "train", "training.max_steps=3", "generate.max_new_tokens=10", "logging.progress=false"]
    proc = subprocess.run(train, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert_ok(proc)
    run = tmp_path / "experiments" / "gpt-text"
    assert (run / "metrics.json").is_file() and '"ddplab": "' + ddplab.__version__ in (run / "env.json").read_text()


def test_the_version_is_written_once():
    """pyproject.toml reads ddplab.__version__; the changelog's newest entry is that version."""
    project = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in project and 'version = { attr = "ddplab.__version__" }' in project
    table = project.split("\n[project]\n", 1)[1].split("\n[", 1)[0]  # [project] alone: no version of its own
    assert not re.search(r"^version\s*=", table, re.MULTILINE)
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert changelog.split("\n## ", 1)[1].startswith(ddplab.__version__)
