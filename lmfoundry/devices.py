"""The `--device` option every verb takes (quantize, eval, eval-gate, serve), read one way.

Torch is imported only where a GPU is asked for or may be present: `serve` checks it in its API
process, which never imports torch on a machine without one (`runtime.engine.core_client`).
"""

from __future__ import annotations

from pathlib import Path

from lmfoundry.errors import UserError

# A GPU driver leaves one of these behind (NVIDIA's, WSL2's GPU paravirtualization, ROCm's); without
# any of them no torch build finds a GPU, and `auto` is the CPU without importing torch to ask.
GPU_DRIVER_PATHS = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def gpu_driver_present() -> bool:
    return any(Path(p).exists() for p in GPU_DRIVER_PATHS)


def check_device(device: str) -> str:
    """A --device value as torch understands it, or a one-line error (cuda asked on a machine
    without one included). `auto` is the GPU where there is one, else the CPU."""
    if device == "cpu" or (device == "auto" and not gpu_driver_present()):
        return "cpu"
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {device!r}: use cpu or cuda[:N]") from None
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"--device {device!r}: use cpu or cuda[:N]")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: this machine has no CUDA GPU (use --device cpu)")
    return str(dev)
