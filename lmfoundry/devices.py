"""The `--device` option every verb takes (quantize, eval, eval-gate, serve), read one way."""

from __future__ import annotations

import torch

from lmfoundry.errors import UserError


def check_device(device: str) -> str:
    """A --device value as torch understands it, or a one-line error (cuda asked on a machine
    without one included). `auto` is the GPU where there is one, else the CPU."""
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
