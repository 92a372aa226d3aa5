"""LoRA adapters over HTTP, as vLLM serves them: a request's `model` names an adapter (or the
base), `/v1/models` lists each adapter with `parent` = the base, and `POST /v1/load_lora_adapter`
{"lora_name", "lora_path"} / `POST /v1/unload_lora_adapter` {"lora_name"} change the set at run
time, behind the API key (the engine reads the folder named in the body: a server reachable by
others needs --api-key). Both are answered once the engine has applied them between two steps:
200 with vLLM's plain-text "Success: ..." line, 400 for an adapter that does not fit the base (the
same one-line refusal as `serve --lora`), 404 for an unknown name, 409 while requests still run
with the adapter being unloaded.

Metrics per adapter, read from the engine's counters at scrape time: ours
(`lmfoundry_lora_requests_running` / `_waiting` / `lmfoundry_lora_requests_total` by `lora_name`,
adapters loaded and slots) and vLLM's `vllm:lora_requests_info` (labels `max_lora`,
`running_lora_adapters`, `waiting_lora_adapters`: comma-separated names; the value is the time of
the scrape, as vLLM sets it), which routers such as llm-d's read to place requests by adapter.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Callable, Iterable

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from lmfoundry.runtime.engine.client import EngineDead, QueueFull
from lmfoundry.runtime.engine.outputs import LoRAResult
from lmfoundry.runtime.server.protocol import StrictModel
from lmfoundry.runtime.server.request_body import APIError, engine_dead

if TYPE_CHECKING:
    from lmfoundry.runtime.server.openai_server import OpenAIServer


class LoadLoRAAdapterRequest(StrictModel):
    """Unknown fields are refused by name (or dropped when lenient), as on every other route."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(StrictModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names identify adapters here


async def _apply(server: OpenAIServer, op: str, name: str, path: str | None) -> LoRAResult:
    try:
        stream = server.engine.lora(f"lora-{uuid.uuid4().hex}", op, name, path)
    except EngineDead as exc:
        raise engine_dead(exc) from None
    except QueueFull as exc:  # a lora command takes no capacity; kept for the client's contract
        raise APIError(429, str(exc), type_="rate_limit_error", code="rate_limit_exceeded") from None
    try:
        async for item in stream:
            if not isinstance(item, LoRAResult):
                break
            server.preparer.adapters = set(item.adapters)
            if item.status != 200:
                raise APIError(item.status, item.message, param="lora_name" if item.status in (404, 409) else None)
            return item
    except EngineDead as exc:
        raise engine_dead(exc) from None
    raise APIError(500, f"the engine did not answer the LoRA {op}", type_="server_error")


def register_lora_routes(api: APIRouter, server: OpenAIServer) -> None:
    """The two routes, on the app's authorized router, and the metrics collector (see module doc)."""
    server.metrics.registry.register(LoRACollector(server.engine.stats, server.model_name))

    def enabled() -> None:
        if not server.lora_enabled:
            raise APIError(400, "LoRA is off on this server: start it with --max-loras N (or --lora NAME=PATH)")

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        req = server.preparer.parse(await server._body(request), LoadLoRAAdapterRequest)
        enabled()
        if req.lora_name in server.names:
            raise APIError(400, f"{req.lora_name!r} is the served model's name; give the adapter another",
                           param="lora_name")
        if req.lora_name in server.preparer.adapters:
            raise APIError(400, f"the LoRA adapter {req.lora_name!r} has already been loaded", param="lora_name")
        result = await _apply(server, "load", req.lora_name, req.lora_path)
        return PlainTextResponse(result.message)

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        req = server.preparer.parse(await server._body(request), UnloadLoRAAdapterRequest)
        enabled()
        result = await _apply(server, "unload", req.lora_name, None)
        return PlainTextResponse(result.message)


class LoRACollector:
    """Per-adapter series from the engine's counters (`LLMEngine._lora_stats`), at scrape time;
    nothing while LoRA is off."""

    def __init__(self, stats: Callable[[], dict[str, float]], model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self) -> Iterable[Metric]:
        s = self.stats()
        if "lora_max" not in s:
            return
        by_kind: dict[str, dict[str, float]] = {"running": {}, "waiting": {}, "requests": {}}
        for key, value in s.items():
            kind, _, name = key.partition(":")
            if kind.startswith("lora_") and name and kind[5:] in by_kind:
                by_kind[kind[5:]][name] = value
        labels = ["model_name", "lora_name"]
        for state in ("running", "waiting"):
            gauge = GaugeMetricFamily(f"lmfoundry_lora_requests_{state}",
                                      f"Sequences {state} with each loaded LoRA adapter", labels=labels)
            for name, value in sorted(by_kind[state].items()):
                gauge.add_metric([self.model_name, name], value)
            yield gauge
        counter = CounterMetricFamily("lmfoundry_lora_requests", "Requests added per LoRA adapter since start",
                                      labels=labels)
        for name, value in sorted(by_kind["requests"].items()):
            counter.add_metric([self.model_name, name], value)
        yield counter
        for name, doc, value in (("lora_adapters_loaded", "LoRA adapters loaded", len(by_kind["running"])),
                                 ("lora_max_adapters", "LoRA adapter slots (--max-loras)", s["lora_max"])):
            gauge = GaugeMetricFamily(f"lmfoundry_{name}", doc, labels=["model_name"])
            gauge.add_metric([self.model_name], value)
            yield gauge
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                 labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        names = {state: ",".join(n for n, v in sorted(by_kind[state].items()) if v) for state in ("running", "waiting")}
        info.add_metric([str(int(s["lora_max"])), names["waiting"], names["running"]], time.time())
        yield info
