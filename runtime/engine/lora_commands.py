"""The engine's LoRA commands: adapters loaded and unloaded at run time (`serve --lora`, the
/v1/load_lora_adapter routes through `EngineClient.lora`), each request's adapter slot, and the
per-adapter counters of `stats()`.

Kept apart from the step loop (llm_engine.py), which reads only a request's slot; `LLMEngine`
takes these calls as a mixin. The adapters themselves (weights, slots) are lora_adapters.py's.
"""

from __future__ import annotations

from typing import Protocol

from lmfoundry.errors import UserError
from lmfoundry.runtime.engine.lora_adapters import AdapterInUse, LoRAManager
from lmfoundry.runtime.engine.outputs import LoRAResult
from lmfoundry.runtime.engine.sampling_params import SamplingParams
from lmfoundry.runtime.engine.scheduler import Scheduler
from lmfoundry.runtime.engine.sequence import Sequence


class _Engine(Protocol):
    """What the LoRA commands use of the engine they are mixed into (`LLMEngine`)."""

    loras: LoRAManager | None
    scheduler: Scheduler
    _requests: dict[str, list[Sequence]]

    def load_lora(self, name: str, path: str) -> None: ...
    def unload_lora(self, name: str) -> None: ...


class LoRACommands:
    """Run-time adapter commands and the adapter lookups of requests and statistics."""

    def _lora_of(self: _Engine, params: SamplingParams) -> tuple[int, int]:
        """(slot, key) of the request's adapter; (-1, 0) for the base. ValueError for an adapter
        that is not loaded (the caller's check raced an unload, or LoRA is off)."""
        if params.lora is None:
            return -1, 0
        if self.loras is None:
            raise ValueError(f"no LoRA adapter named {params.lora!r}: this engine serves none (LoRA is off)")
        adapter = self.loras.resolve(params.lora)
        return adapter.slot, adapter.key

    def load_lora(self: _Engine, name: str, path: str) -> None:
        """Load a PEFT LoRA folder as adapter `name` (UserError, and nothing loaded, when it does
        not fit the base or no slot is free)."""
        if self.loras is None:
            raise UserError("LoRA is off in this engine: start it with max_loras (serve --max-loras or --lora)")
        self.loras.load(name, path)

    def unload_lora(self: _Engine, name: str) -> None:
        """Unload adapter `name`; refused (UserError) while a request uses it."""
        if self.loras is None or name not in self.loras.adapters:
            raise KeyError(name)
        key = self.loras.adapters[name].key
        users = sum(1 for seqs in self._requests.values() if any(s.lora_key == key for s in seqs))
        if users:
            raise AdapterInUse(f"the LoRA adapter {name!r} is in use by {users} request(s); unload it when they finish")
        self.loras.unload(name)

    def lora_command(self: _Engine, request_id: str, op: str, name: str, path: str | None) -> LoRAResult:
        """A run-time load or unload (`EngineClient.lora`), answered with the HTTP status to give."""
        try:
            if op == "load":
                self.load_lora(name, str(path))
                message = f"Success: LoRA adapter '{name}' added successfully."
            elif op == "unload":
                self.unload_lora(name)
                message = f"Success: LoRA adapter '{name}' removed successfully."
            else:
                raise ValueError(f"unknown LoRA operation {op!r}")
            status = 200
        except KeyError:
            status, message = 404, f"the LoRA adapter {name!r} is not loaded"
        except UserError as exc:
            status, message = 409 if isinstance(exc, AdapterInUse) else 400, str(exc)
        return LoRAResult(request_id, status, message, tuple(self.loras.adapters) if self.loras else ())

    def _lora_stats(self: _Engine) -> dict[str, float]:
        """Per adapter: "lora_running:NAME" / "lora_waiting:NAME" sequences and "lora_requests:NAME"
        requests added so far; "lora_max" slots (nothing when LoRA is off)."""
        if self.loras is None:
            return {}
        out: dict[str, float] = {"lora_max": float(self.loras.max_loras)}
        slots = {a.slot: name for name, a in self.loras.adapters.items()}
        for name, count in self.loras.requests.items():
            out[f"lora_requests:{name}"] = float(count)
        for name in self.loras.adapters:
            out[f"lora_running:{name}"] = out[f"lora_waiting:{name}"] = 0.0
        for state, seqs in (("running", self.scheduler.running), ("waiting", self.scheduler.waiting)):
            for seq in seqs:
                if seq.lora_slot in slots:
                    out[f"lora_{state}:{slots[seq.lora_slot]}"] += 1
        return out
