"""The handling of the OpenAI-compatible API's requests (`OpenAIServer`): each route's body read,
prepared off the event loop, submitted to the `EngineClient` and answered whole or as a stream of
server-sent events; the tokenizer endpoints; draining at shutdown. app.py registers the routes,
the API key, the error shapes and CORS around it (its docstring describes the API as a whole).

The event loop only moves bytes: the body is read with a size limit and a deadline
(request_body.py), then parsing, the chat template, tokenization and the request's one validation
run in a small thread pool (prepare.py), so the other streams keep flowing; the engine streams
token ids, whose text and stop strings are worked out here (output_processor.py).
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, AsyncIterator, Callable, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lmfoundry.runtime.engine.client import (
    EngineClient,
    EngineDead,
    EngineRequest,
    QueueFull,
    RequestStream,
    ShuttingDown,
    merge_events,
)
from lmfoundry.runtime.engine.output_processor import detokenize
from lmfoundry.runtime.engine.outputs import StepEvent
from lmfoundry.runtime.engine.sampling_params import SamplingParams
from lmfoundry.runtime.engine.validation import RequestValidator
from lmfoundry.runtime.server.background import DEFAULT_READ_TIMEOUT
from lmfoundry.runtime.server.metrics import ServerMetrics
from lmfoundry.runtime.server.prepare import Preparer
from lmfoundry.runtime.server.protocol import DetokenizeRequest, TokenizeRequest
from lmfoundry.runtime.server.request_body import (
    APIError,
    ClientGone,
    engine_dead,
    read_body,
    require_json,
)
from lmfoundry.runtime.server.responses import ChatBuilder, CompletionBuilder
from lmfoundry.runtime.server.responses_api import ResponseBuilder, prepare_response

MAX_N = 8
# Enough for any prompt that fits a long context as text or token ids; larger bodies get 413.
DEFAULT_MAX_BODY_BYTES = 8 * 2**20
PREP_THREADS = 4  # parse + chat template + tokenize, off the event loop

T = TypeVar("T")
# Characters str.splitlines() ends a line at that JSON leaves raw: a client that reads the event
# stream with it (httpx's iter_lines does) would cut a chunk whose text holds one of them in two.
# SSE itself ends lines at CR and LF only, which JSON always escapes.
_LINE_BREAKS = {ord(c): f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"}


def sse_event(payload: Any) -> str:
    """One server-sent event of a JSON payload; non-ASCII text stays UTF-8, except the characters
    some line readers split at, which are escaped (the payload decodes to the same value)."""
    return f"data: {json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"


class OpenAIServer:
    """Request handling, separated from route registration so that it reads top to bottom."""

    def __init__(self, engine: EngineClient, model_name: str, aliases: tuple[str, ...] = (),
                 max_n: int = MAX_N, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 read_timeout: float = DEFAULT_READ_TIMEOUT, metrics_names: str = "both",
                 lenient_request_fields: bool = False) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.names = {model_name, *aliases}
        self.max_n = max_n
        self.max_body_bytes = max_body_bytes
        self.read_timeout = read_timeout
        self.vocab_size = engine.info.vocab_size
        self.max_model_len = engine.info.max_model_len
        self.metrics = ServerMetrics(engine.stats, model_name, self.max_model_len, metrics_names,
                                     {k: "" if v is None else str(v) for k, v in self.runtime().items()})
        self.created = int(time.time())
        self.prep = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="lmfoundry-prep")
        self.draining = False
        self.lora_enabled = engine.info.max_loras > 0
        # every request body is parsed and checked here, into what the engine and the response need
        self.preparer = Preparer(RequestValidator(engine.info, self.tokenizer), model_name, self.names,
                                 set(engine.info.loras), max_n, lenient_request_fields)

    def runtime(self) -> dict[str, Any]:
        """What the engine runs (`EngineInfo`, read from the loaded model): the `lmfoundry` object of
        /v1/models and the labels of `lmfoundry_model_info`."""
        info = self.engine.info
        return {"dtype": info.dtype, "device": info.device, "cpu_isa": info.cpu_isa,
                "weight_format": info.weight_format}

    async def _body(self, request: Request) -> bytes:
        require_json(request)
        return await read_body(request, self.max_body_bytes, self.read_timeout)

    async def _off_loop(self, fn: Callable[[bytes], T], body: bytes) -> T:
        """Run request preparation (parse, template, tokenize) in the prep pool."""
        return await asyncio.get_running_loop().run_in_executor(self.prep, fn, body)

    def _admit(self) -> None:
        """Refuse new work while the server stops (see `drain`)."""
        if self.draining:
            raise APIError(503, "the server is shutting down; send the request to another instance",
                           type_="server_error", code="server_shutting_down")

    async def drain(self, timeout: float, forced: Callable[[], bool] = lambda: False) -> int:
        """Stop admitting requests (503 from now on), let those in the engine finish for up to
        `timeout` seconds (or until `forced()`), then fail the rest with an error their clients see
        and abort them in the engine; returns how many were failed."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.engine.num_unfinished_seqs and time.monotonic() < deadline and not forced():
            await asyncio.sleep(0.05)
        return self.engine.stop_all(ShuttingDown(
            f"the server is shutting down and the request did not finish within its {timeout:g} s drain"))

    def _submit(self, prompts: list[list[int]], params: SamplingParams, base_id: str,
                start: float) -> AsyncIterator[tuple[int, StepEvent]]:
        """Enqueue every prompt as its own engine request (all or none); return their events as
        (prompt index, event), interleaved."""
        self._admit()
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                streams.append(self.engine.submit(EngineRequest(f"{base_id}-{i}", ids, params, start)))
        except (QueueFull, EngineDead, ValueError) as exc:
            for st in streams:
                st.abort()
            if isinstance(exc, QueueFull):
                raise APIError(429, str(exc), type_="rate_limit_error", code="rate_limit_exceeded") from None
            if isinstance(exc, EngineDead):
                raise engine_dead(exc) from None
            raise APIError(400, str(exc)) from None
        eos = self.engine.info.eos_token_ids
        return merge_events([self.metrics.observe(detokenize(st.__aiter__(), ids, params, self.tokenizer, eos), start, params)
                       for st, ids in zip(streams, prompts, strict=True)], streams)

    # ---- /v1/completions --------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        start = time.monotonic()
        job = await self._off_loop(self.preparer.completion, await self._body(request))
        rid = f"cmpl-{uuid.uuid4().hex}"
        events = self._submit(job.prompts, job.params, rid, start)
        builder = CompletionBuilder(job, rid, self.preparer.token_text)
        if job.req.stream:
            return self._stream(request, builder.chunks(events), rid)
        result = await self._collect(request, builder.collect(events))
        return JSONResponse(result)

    # ---- /v1/chat/completions ---------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        start = time.monotonic()
        chat = await self._off_loop(self.preparer.chat, await self._body(request))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        events = self._submit([chat.prompt], chat.params, rid, start)
        builder = ChatBuilder(chat, rid, self.preparer.token_text)
        if chat.req.stream:
            return self._stream(request, builder.chunks(events), rid)
        result = await self._collect(request, builder.collect(events))
        return JSONResponse(result)

    # ---- /v1/responses ----------------------------------------------------------------------
    async def responses(self, request: Request) -> Response:
        """A chat request underneath (responses_api.py): the chat preparation, its own body."""
        start = time.monotonic()
        req, chat = await self._off_loop(partial(prepare_response, self.preparer), await self._body(request))
        rid = f"resp_{uuid.uuid4().hex}"
        events = self._submit([chat.prompt], chat.params, rid, start)
        builder = ResponseBuilder(req, chat, rid, self.preparer.token_text)
        if req.stream:
            return StreamingResponse(builder.events(events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        return JSONResponse(await self._collect(request, builder.collect(events)))

    # ---- /v1/embeddings ---------------------------------------------------------------------
    async def embeddings(self, request: Request) -> Response:
        req, prompts = await self._off_loop(self.preparer.embedding, await self._body(request))
        rid = f"embd-{uuid.uuid4().hex}"
        self._admit()
        try:
            stream = self.engine.embed(rid, prompts)
        except QueueFull as exc:
            raise APIError(429, str(exc), type_="rate_limit_error", code="rate_limit_exceeded") from None
        except EngineDead as exc:
            raise engine_dead(exc) from None

        async def result() -> Any:
            async for item in stream:
                return item
            raise RuntimeError("the engine ended the request without a result")

        out = await self._collect(request, result())
        data = []
        for i, vector in enumerate(out.embeddings):
            value: Any = vector
            if req.encoding_format == "base64":  # little-endian float32, as OpenAI sends it
                value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": value})
        return JSONResponse({"object": "list", "data": data, "model": self.model_name,
                             "usage": {"prompt_tokens": out.num_tokens, "total_tokens": out.num_tokens}})

    # ---- plumbing ---------------------------------------------------------------------------
    def _stream(self, request: Request, chunks: AsyncIterator[dict], rid: str) -> StreamingResponse:
        async def sse() -> AsyncIterator[str]:
            try:
                async for chunk in chunks:
                    yield sse_event(chunk)
            except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
                code = "server_shutting_down" if isinstance(exc, ShuttingDown) else None
                err = {"error": {"message": str(exc), "type": "server_error", "param": None, "code": code}}
                yield sse_event(err)
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": rid})

    async def _collect(self, request: Request, work: Any) -> Any:
        """Await a whole response, aborting it if the client goes away first."""
        task = asyncio.ensure_future(work)

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(disconnected())
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            watcher.cancel()
            try:
                return task.result()
            except EngineDead as exc:
                raise engine_dead(exc) from None
            except Exception as exc:  # noqa: BLE001 - the engine failed this request (logged by its thread)
                raise APIError(500, str(exc), type_="server_error") from None
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):  # noqa: BLE001
            pass
        raise ClientGone()

    def models(self) -> dict:
        base = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "lmfoundry",
                "max_model_len": self.max_model_len, "lmfoundry": self.runtime()}
        # each LoRA adapter (lora_routes.py) is a model of its own, with `parent` the base (vLLM's shape)
        adapters = [{**base, "id": name, "root": name, "parent": self.model_name}
                    for name in sorted(self.preparer.adapters)]
        return {"object": "list", "data": [base, *adapters]}

    # ---- tokenizer endpoints (vLLM's) -----------------------------------------------------
    def _tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        return self.tokenizer

    def tokenizer_info(self) -> dict:
        tok = self._tokenizer()
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "chat_template": getattr(tok, "chat_template", None),
                "model_max_length": self.max_model_len}

    def _tokenize(self, body: bytes) -> dict:
        req = self.preparer.parse(body, TokenizeRequest)
        self.preparer.check_model(req.model)
        ids = list(self._tokenizer()(req.prompt, add_special_tokens=req.add_special_tokens).input_ids)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    def _detokenize(self, body: bytes) -> dict:
        req = self.preparer.parse(body, DetokenizeRequest)
        self.preparer.check_model(req.model)
        if req.tokens and (min(req.tokens) < 0 or max(req.tokens) >= self.vocab_size):
            raise APIError(400, f"tokens must be token ids in [0, {self.vocab_size})", param="tokens")
        return {"prompt": self._tokenizer().decode(req.tokens)}

    async def tokenize(self, request: Request) -> dict:
        return await self._off_loop(self._tokenize, await self._body(request))

    async def detokenize(self, request: Request) -> dict:
        return await self._off_loop(self._detokenize, await self._body(request))
