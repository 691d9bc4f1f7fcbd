"""GPU monitoring: inactive without a GPU or NVML, sampled in the background with one."""

import sys
import time
import types

import pytest
import torch

from ddplab.metrics.gpu import GpuMonitor


def test_no_gpu_means_no_monitoring_and_no_columns():
    monitor = GpuMonitor(torch.device("cpu"), interval_s=0.01)
    assert not monitor.active and monitor.take_epoch() == {}
    monitor.close()


def _fake_nvml(fail_init=False):
    readings = iter([(10, 100), (30, 300), (20, 200)] + [(20, 200)] * 10_000)
    calls = {"shutdown": 0}

    def init():
        if fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def utilization(handle):
        util, mem = next(readings)
        calls["mem"] = mem
        return types.SimpleNamespace(gpu=util)

    def memory(handle):
        return types.SimpleNamespace(used=calls["mem"] * 2**20)

    module = types.SimpleNamespace(
        nvmlInit=init,
        nvmlDeviceGetHandleByIndex=lambda i: ("handle", i),
        nvmlDeviceGetUtilizationRates=utilization,
        nvmlDeviceGetMemoryInfo=memory,
        nvmlShutdown=lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1),
    )
    return module, calls


def test_nvml_failure_is_skipped_cleanly(monkeypatch):
    fake, _ = _fake_nvml(fail_init=True)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monitor = GpuMonitor(torch.device("cuda", 0), interval_s=0.01)
    assert not monitor.active and monitor.take_epoch() == {}
    monitor.close()


def test_background_samples_give_mean_utilisation_and_peak_memory(monkeypatch):
    fake, calls = _fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monitor = GpuMonitor(torch.device("cuda", 0), interval_s=0.005)
    assert monitor.active
    deadline = time.time() + 5
    while len(monitor._samples) < 3 and time.time() < deadline:
        time.sleep(0.01)
    monitor.close()  # no more samples after this
    row = monitor.take_epoch()
    assert row["gpu_mem_mb"] == 300 and 10 <= row["gpu_util"] <= 30
    assert monitor.take_epoch() == {}  # counters restart each epoch
    assert calls["shutdown"] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_gpu_reports_utilisation_and_memory():
    monitor = GpuMonitor(torch.device("cuda", 0), interval_s=0.05)
    x = torch.randn(4096, 4096, device="cuda")
    end = time.time() + 1.0
    while time.time() < end:
        x = x @ x
        x = x / x.norm()
    torch.cuda.synchronize()
    row = monitor.take_epoch()
    monitor.close()
    assert row["gpu_mem_mb"] > 64 and 0 <= row["gpu_util"] <= 100
