"""Model FLOPs utilisation: achieved training FLOP/s over the devices' peak.

Peaks are dense bf16/fp16 tensor-core figures from the vendors' data sheets (the usual MFU reference, as in
the PaLM paper); FLOPs per token are the model's own `flops_per_token()` (forward + backward).
"""

from __future__ import annotations

import torch

# Device-name substring -> peak dense bf16 TFLOP/s. Longer, more specific names first.
PEAK_TFLOPS: dict[str, float] = {
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 70.0,
    "A10": 125.0,
    "L4": 121.0,
    "V100": 125.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
    "T4": 65.0,
}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for key, tflops in PEAK_TFLOPS.items() if key in name), None)


def mfu(model: torch.nn.Module, tokens_per_s: float | None, device: torch.device, world_size: int) -> float | None:
    """Global tokens/s x FLOPs per token over (peak x processes); None for CPUs and unknown devices."""
    peak = peak_flops(device)
    flops_per_token = getattr(model, "flops_per_token", None)
    if not peak or not tokens_per_s or flops_per_token is None:
        return None
    return tokens_per_s * flops_per_token() / (peak * world_size)
