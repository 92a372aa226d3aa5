"""The options of every verb that runs a model through the serving runtime (`serve`, `eval`,
`eval-gate`): where an engine bundle's kernels run (--device), the execution dtype of a
checkpoint on CPU (--dtype) and, for the evaluating verbs, the tensor-parallel degree (--tp),
defined once so that the verbs take them alike."""

from __future__ import annotations

from typing import Any, Callable

import click

from lmfoundry.runtime.dtypes import DTYPES

F = Callable[..., Any]


def device_option(command: F) -> F:
    """--device: cpu or cuda[:N], where an engine bundle runs its kernels (checkpoints run on CPU)."""
    return click.option(
        "--device", default="cpu", show_default=True,
        help="cpu or cuda[:N]: where an engine bundle (`lmfoundry compile` output) runs its kernels: shipped "
             "cubins on a matching GPU, Triton JIT otherwise, each kernel's PyTorch reference on CPU. A checkpoint "
             "folder or model name runs the PyTorch reference model on CPU.")(command)


def dtype_option(command: F) -> F:
    """--dtype: the execution dtype of checkpoints on CPU (auto: what this CPU runs fastest)."""
    return click.option(
        "--dtype", type=click.Choice(DTYPES), default="auto", show_default=True,
        help="Execution dtype of checkpoints on CPU. auto: bfloat16 where the CPU has bf16 arithmetic "
             "(AVX512-BF16/AMX) or runs the runtime's AVX2 kernels (which widen bf16 in registers), W4A16/W8A16 "
             "weights then staying packed as `serve` runs them; float32 elsewhere. An engine bundle on a GPU keeps "
             "its own.")(command)


def tp_option(command: F) -> F:
    """--tp of the evaluating verbs: each model split over that many processes, as `serve --tp` runs it."""
    return click.option(
        "--tp", type=int, default=1, show_default=True,
        help="Split each model over this many processes, as `serve --tp` runs it (must divide the "
             "attention heads and MLP width; `lmfoundry plan --tp` lists the valid sizes; a bundle runs at "
             "the degree it was compiled for).")(command)
