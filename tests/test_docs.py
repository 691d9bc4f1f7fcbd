"""The docs: the site builds with no broken link or anchor, the config reference matches the
config dataclasses' own help, and the README stays a front page whose links resolve."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config", ROOT / "docs" / "gen_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_site_builds_strict_with_no_broken_link(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[docs]')")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    config_page = (tmp_path / "site" / "config" / "index.html").read_text()
    assert "training.time_budget" in config_page and "distributed.comm_hook" in config_page


def test_config_reference_is_generated_from_the_current_config():
    gen = _generator()
    assert (ROOT / "docs" / "config.md").read_text() == gen.render(), (
        "docs/config.md is stale: run python docs/gen_config.py"
    )


def test_config_reference_lists_every_field_with_its_help_and_resume_safety():
    from ddplab.config import describe_fields

    page = _generator().render()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([a-z_]+(?:\.[a-z_0-9]+)+)` \|.*$", page, re.M)}
    assert set(rows) == {name for name, _, _ in describe_fields()}
    assert "seed for weights, data order, dropout" in rows["experiment.seed"]
    assert "| yes |" in rows["training.epochs"] and "| yes |" in rows["logging.log_every"]  # safe on resume
    assert "| yes |" not in rows["training.lr"]  # batch_size is safe: a resume keeps the global batch
    assert "cosine, linear, constant, or your own file.py:function" in rows["training.schedule"]


def test_readme_is_a_front_page_whose_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "make demo   # " in text and "make test   # " in text
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), f"README links a missing file: {target}"
