"""GPU utilisation and memory of this process's GPU, sampled in the background via NVML.

NVML's utilisation is the share of its last sample period (1/6 s to 1 s, by GPU) in which a kernel ran.
Samples are taken every 0.5 s while `gate()` says the loop is training, so evaluation and snapshots do not
dilute the figure. Where NVML cannot start, the monitor reports nothing; training never depends on it."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

import torch


class GpuMonitor:
    def __init__(self, device: torch.device, interval_s: float = 0.5, gate=lambda: True) -> None:
        self.interval_s, self.gate = interval_s, gate
        self._samples: list[tuple[float, float]] = []  # (utilisation %, memory used MiB)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None  # the pynvml module once NVML answered (it has no type information)
        self._handle: Any = None
        self.active = False  # True once NVML answered; stays True after close for the last epoch
        if device.type != "cuda":
            return
        try:
            import pynvml  # NVIDIA's library: only on a CUDA device

            pynvml.nvmlInit()
            ids = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
            index = device.index or 0  # CUDA counts the GPUs in CUDA_VISIBLE_DEVICES, NVML counts them all
            if index < len(ids) and ids[index].isdigit():
                index = int(ids[index])
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - any NVML failure means: no monitoring
            return
        self.active = True
        self._thread = threading.Thread(target=self._run, name="ddplab-gpu-monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.gate():
                with contextlib.suppress(Exception):  # a failed read skips one sample
                    util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
                    used = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used / 2**20
                    with self._lock:
                        self._samples.append((float(util), float(used)))
            self._stop.wait(self.interval_s)

    def take_epoch(self) -> dict:
        """Mean utilisation (%) and peak memory used (MiB) since the last call; {} when inactive."""
        with self._lock:
            samples, self._samples = self._samples, []
        if not samples:
            return {}
        return {"gpu_util": sum(u for u, _ in samples) / len(samples), "gpu_mem_mb": max(m for _, m in samples)}

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml = None
