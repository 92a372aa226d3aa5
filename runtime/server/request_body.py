"""Request bodies and API errors at the HTTP boundary, shared by every route.

A body is read with a size limit and a deadline (a stalled or oversized upload must not hold a
slot or memory), must be application/json (browsers send other types cross-site without a CORS
preflight), and is parsed into the route's pydantic schema; every refusal is an `APIError` that
renders OpenAI's error body {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from lmfoundry.runtime.engine.client import EngineDead, ShuttingDown

log = logging.getLogger("lmfoundry.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.close = close  # the body was not read to its end: end the connection rather than drain it

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers={"Connection": "close"} if self.close else None)


class ClientGone(Exception):
    """The client disconnected before its body arrived: nothing to answer."""


def engine_dead(exc: EngineDead) -> APIError:
    if isinstance(exc, ShuttingDown):
        return APIError(503, str(exc), type_="server_error", code="server_shutting_down")
    return APIError(503, f"the engine is not running: {exc}", type_="server_error", code="engine_unavailable")


def validation_message(exc: ValidationError, where: tuple[str, ...] = ()) -> tuple[str, str | None]:
    """The first error as a one-line message and the `param` it names; `where`: the location of the
    validated value in the body."""
    err = exc.errors()[0]
    loc = ".".join(str(x) for x in (*where, *err.get("loc", ())))
    return (f"{loc}: {err.get('msg')}" if loc else str(err.get("msg"))), loc or None


def require_json(request: Request) -> None:
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, f"the request body must be sent as Content-Type: application/json, got "
                            f"{media_type or 'no Content-Type'}", code="unsupported_media_type", close=True)


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, refused (413) past `limit` bytes without reading the rest, and (408) when it has
    not all arrived `timeout` seconds after the headers: a stalled client must not hold a slot."""
    too_large = APIError(413, f"the request body is larger than the server's limit of {limit} bytes",
                         code="request_too_large", close=True)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large

    async def receive() -> bytes:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
        return bytes(body)

    try:
        return await asyncio.wait_for(receive(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="request_timeout",
                       close=True) from None
    except ClientDisconnect:
        raise ClientGone() from None


def parse_body(body: bytes, schema: type[BaseModel], lenient: bool = False) -> Any:
    """The body as `schema`, or a 400. The one place unknown fields are handled: the schemas
    forbid them, and each is refused naming it, as OpenAI refuses an unrecognized argument, or,
    when `lenient` (`serve --lenient-request-fields`), logged and dropped as vLLM does."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except ValueError as exc:  # also UnicodeDecodeError and over-long integer literals
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    return _validate(body, data, schema, lenient, ())


def parse_field(value: dict[str, Any], schema: type[BaseModel], lenient: bool, name: str) -> Any:
    """A body field the request schema leaves untyped (chat's `tool_choice`, a string or an object,
    checked on its own for a clearer message) as `schema`, under the body's rules: its unknown keys
    are refused by name, or dropped when `lenient`; `name`: the field, for the messages."""
    raw = json.dumps(value).encode()
    return _validate(raw, json.loads(raw), schema, lenient, (name,))  # a copy: dropping keys leaves `value` as sent


def _validate(raw: bytes, data: dict[str, Any], schema: type[BaseModel], lenient: bool, where: tuple[str, ...]) -> Any:
    """`raw` (the JSON of `data`, located at `where` in the body) as `schema`; see `parse_body`."""
    try:
        return schema.model_validate_json(raw)
    except ValidationError as exc:
        unknown = [err["loc"] for err in exc.errors() if err["type"] == "extra_forbidden"]
        if not unknown:
            message, param = validation_message(exc, where)
            raise APIError(400, message, param=param) from None
    names = [".".join(str(x) for x in (*where, *loc)) for loc in unknown]
    if not lenient:
        many = "s" if len(names) > 1 else ""
        raise APIError(400, f"Unrecognized request argument{many} supplied: {', '.join(names)} (this server refuses "
                            "fields it does not know; `lmfoundry serve --lenient-request-fields` ignores them)",
                       param=names[0])
    log.warning("ignored unknown request field%s: %s", "s" if len(names) > 1 else "", ", ".join(names))
    for *path, key in unknown:
        node: Any = data
        for step in path:  # (a step that is not in the data, such as a union member's tag, ends the walk)
            if isinstance(node, dict):
                node = node.get(step)
            else:
                node = node[step] if isinstance(node, list) and isinstance(step, int) and step < len(node) else None
        if isinstance(node, dict):
            node.pop(key, None)
    return _validate(json.dumps(data).encode(), data, schema, False, where)  # anything left is refused
