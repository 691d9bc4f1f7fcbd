"""The line that names a missing extra installs it without asking a registry for a package called ddplab."""

from __future__ import annotations

import shlex
from importlib import metadata

import pytest
import tomllib

from conftest import ROOT
from ddplab.runtime import extras

DECLARED = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


@pytest.mark.parametrize("extra", ["text", "vision", "ft", "ray"])
def test_the_line_installs_the_extras_own_packages(extra):
    line = extras.install_line(extra)
    command, name = line.split(" (")
    assert shlex.split(command) == ["pip", "install", *DECLARED[extra]] and name == f"ddplab's {extra} extra)"


def test_a_tree_that_was_never_installed_is_sent_to_its_clone(monkeypatch):
    def absent(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "requires", absent)
    assert extras.install_line("text") == "pip install '.[text]' in ddplab's clone"
