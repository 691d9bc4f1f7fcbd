"""Freed host memory stays in the process: a step's buffers cost no page faults after the first."""

import platform
import subprocess
import sys

import pytest

from conftest import _env

MIB = 1 << 20
STEPS = """
import resource, sys, torch
from ddplab.runtime.process_state import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else 0

def step():  # a step's buffers, freed and allocated out of order: 48 and 24 MiB of float32
    a = torch.empty(12 << 20).fill_(1.0)
    b = torch.empty(6 << 20).fill_(2.0)
    del a
    c = torch.empty(12 << 20).fill_(3.0)
    return float(b[-1] + c[-1])

for _ in range(10):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(kept, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def faults_per_step(mode: str) -> tuple[int, float]:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], env=_env(), capture_output=True, text=True, check=True)
    kept, faults = out.stdout.split()
    return int(kept), float(faults)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_kept_memory_ends_the_page_faults_glibc_takes_every_step():
    # Blocks over 32 MiB are always fresh pages under glibc's defaults: 2 x 48 MiB a step, 24576 pages.
    _, default_faults = faults_per_step("default")
    assert default_faults > 20000, default_faults
    kept, faults = faults_per_step("keep")
    if kept < 48 * MIB:
        pytest.skip(f"this glibc keeps blocks below {kept // MIB} MiB only")
    assert faults < 10, faults
