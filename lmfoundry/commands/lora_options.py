"""`serve`'s LoRA options: `--lora NAME=PATH` (repeated), vLLM's `--lora-modules NAME=PATH ...`
(several after one flag, or its JSON form {"name", "path"}), `--enable-lora`, `--max-loras`,
`--max-lora-rank`; every adapter checked against the base before the engine starts, so a
refusal is one line and nothing is loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from lmfoundry.errors import UserError

if TYPE_CHECKING:
    from lmfoundry.model.config import ModelConfig


def parse_spec(value: str, flag: str) -> tuple[str, str]:
    """(name, path) of one NAME=PATH or {"name": ..., "path": ...} value."""
    if value.lstrip().startswith("{"):
        try:
            spec = json.loads(value)
        except json.JSONDecodeError:
            raise UserError(f"{flag} {value!r}: not valid JSON") from None
        name, path = (spec.get("name"), spec.get("path")) if isinstance(spec, dict) else (None, None)
        if not isinstance(name, str) or not isinstance(path, str):
            raise UserError(f"{flag} {value!r}: the JSON form needs string fields \"name\" and \"path\"")
    else:
        name, sep, path = value.partition("=")
        if not sep:
            raise UserError(f"{flag} {value!r}: expected NAME=PATH")
    if not name.strip() or name != name.strip() or not path:
        raise UserError(f"{flag} {value!r}: expected NAME=PATH with a name and a path")
    return name, path


def split_positionals(model: str, extras: tuple[str, ...], vllm_modules: tuple[str, ...]
                      ) -> tuple[str, tuple[str, ...]]:
    """MODEL and vLLM's `--lora-modules` values: click gives one value to the option and the rest
    (`--lora-modules a=P b=Q`) to the positional arguments. With --lora-modules, positional
    NAME=PATH values that name no file are adapters; exactly one other value is MODEL."""
    if not extras:
        return model, vllm_modules
    if not vllm_modules:
        raise UserError(f"unexpected extra argument {extras[0]!r} (one MODEL; adapters go after --lora NAME=PATH)")
    positional = [model, *extras]
    adapters = [v for v in positional if "=" in v and not Path(v).exists()]
    models = [v for v in positional if v not in adapters]
    if len(models) != 1:
        raise UserError(f"expected one MODEL besides the --lora-modules NAME=PATH values, got {models}")
    return models[0], (*vllm_modules, *adapters)


def lora_config(model: str, loras: Iterable[tuple[str, str]], enable: bool, max_loras: int | None,
                max_rank: int, served_name: str, tp: int, device: str) -> tuple[int, tuple[tuple[str, str], ...]]:
    """(slots, adapters) for the engine: (0, ()) with LoRA off. Refuses, before anything loads,
    what the engine would: duplicate or clashing names, too few slots or a rank below 1, the
    paths LoRA does not run on, and each adapter that does not fit the base (`check_adapter`)."""
    specs = tuple(loras)
    if not specs and not enable and max_loras is None:
        return 0, ()
    if max_rank < 1:
        raise UserError(f"--max-lora-rank must be at least 1, got {max_rank}")
    slots = max_loras if max_loras is not None else max(1, len(specs))
    if slots < max(1, len(specs)):
        raise UserError(f"--max-loras {slots} holds fewer adapters than the {len(specs)} given")
    names = [name for name, _ in specs]
    for name in names:
        if names.count(name) > 1:
            raise UserError(f"the LoRA adapter name {name!r} is given twice")
        if name == served_name:
            raise UserError(f"the LoRA adapter name {name!r} is the served model's name; give the adapter another")
    if tp > 1:
        raise UserError("LoRA adapters with --tp are not implemented (serve the adapters on one process)")
    from lmfoundry.engine_bundle.engine_manifest import is_engine_bundle
    from lmfoundry.runtime.loader import whole_model_config

    if device != "cpu" and is_engine_bundle(model):
        from lmfoundry.engine_bundle.engine_manifest import read_manifest

        record = read_manifest(Path(model)).get("lora")
        if record is None:
            raise UserError(f"{model}: this engine bundle has no LoRA kernels; compile it with `lmfoundry compile ... "
                            "--max-loras N --max-lora-rank R` to serve adapters on it")
        if slots > record["max_loras"] or max_rank > record["max_rank"]:
            raise UserError(f"{model}: its LoRA kernels serve --max-loras {record['max_loras']} and --max-lora-rank "
                            f"{record['max_rank']}; asked {slots} and {max_rank}")
    from lmfoundry.checkpoint.lora_adapter import check_adapter

    base = whole_model_config(model)
    if device == "cpu":  # a GPU's free memory is the engine's to read (`lora_adapters.check_slots_fit`)
        check_lora_memory(base, slots, max_rank)
    for name, path in specs:
        try:
            check_adapter(path, base, max_rank)
        except UserError as exc:
            raise UserError(f"--lora {name}: {exc}") from None
    return slots, specs


def check_lora_memory(base: ModelConfig, slots: int, max_rank: int) -> None:
    """Refuse, before the model loads, adapter slots whose stacked weights alone are more than
    this machine's available memory (--max-loras 100000000 ended in the allocator's traceback
    after the load). Counted at 16 bits an element, the least the stack takes
    (`capacity.arithmetic.lora_bytes`, what `plan --max-loras` counts); the engine checks again
    with its dtype once the model is in memory."""
    import psutil

    from lmfoundry.capacity.arithmetic import lora_bytes
    from lmfoundry.runtime.engine.engine_config import check_lora_slots_fit

    check_lora_slots_fit(slots, max_rank, lora_bytes(base, 1, max_rank), psutil.virtual_memory().available,
                         "of memory available")
