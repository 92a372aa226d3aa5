"""serve's HTTP-facing flags (CORS with vLLM's names, unknown request fields, metric names,
/openapi.json, body and time limits): their click options, their range checks and the app's
`ApiOptions` they make."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import click

from lmfoundry.errors import UserError

if TYPE_CHECKING:
    from lmfoundry.runtime.server.app import ApiOptions


def check_server_options(port: int, max_model_len: int | None, max_waiting: int, kv_cache_gb: float,
                         threads: int | None, max_request_mb: float, timeout_read: float,
                         timeout_keep_alive: float, shutdown_timeout: float) -> None:
    """Refuse out-of-range options in one line before loading the model (--kv-cache-gb 0 used to
    run with one block, --max-waiting -5 shrank the running capacity, nan reached the allocator)."""
    if not 0 <= port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {port}")
    if max_model_len is not None and max_model_len < 2:
        raise UserError(f"--max-model-len must be at least 2 (a prompt token and an output token), got {max_model_len}")
    if max_waiting < 0:
        raise UserError(f"--max-waiting must be at least 0, got {max_waiting}")
    if threads is not None and threads < 1:
        raise UserError(f"--threads must be at least 1, got {threads}")
    for name, value in (("--kv-cache-gb", kv_cache_gb), ("--max-request-mb", max_request_mb),
                        ("--timeout-read", timeout_read), ("--timeout-keep-alive", timeout_keep_alive)):
        if not (math.isfinite(value) and value > 0):
            raise UserError(f"{name} must be a positive number, got {value}")
    if not (math.isfinite(shutdown_timeout) and shutdown_timeout >= 0):
        raise UserError(f"--shutdown-timeout must be a number of seconds >= 0, got {shutdown_timeout}")


def http_options(command: Any) -> Any:
    """serve's HTTP-facing flags (CORS with vLLM's names, unknown request fields, metric names,
    /openapi.json); `api_options` turns them into the app's `ApiOptions`."""
    listed = "; several values: the option repeated, commas, or a JSON list as vLLM takes it"
    options = [
        click.option("--allowed-origins", multiple=True,
                     help="CORS: origins whose browser pages may call the API, e.g. http://localhost:3000, or '*' "
                          f"(default: none, no CORS; vLLM's default is '*'){listed}."),
        click.option("--allowed-methods", multiple=True, help=f"CORS: methods allowed (default '*'){listed}."),
        click.option("--allowed-headers", multiple=True, help=f"CORS: request headers allowed (default '*'){listed}."),
        click.option("--allow-credentials", is_flag=True,
                     help="CORS: allow cookies and Authorization from those origins (listed explicitly: not with '*')."),
        click.option("--lenient-request-fields", is_flag=True,
                     help="Log and ignore request fields this server does not know (vLLM's behaviour) instead of "
                          "refusing the request with HTTP 400 naming them (OpenAI's), for clients that send extras."),
        click.option("--metrics-names", type=click.Choice(["ours", "vllm", "both"]), default="both", show_default=True,
                     help="/metrics series: ours (lmfoundry_*, what `promtool check metrics` accepts), vLLM's names "
                          "(vllm:*, for dashboards and autoscalers built for vLLM; promtool refuses their ':') or both."),
        click.option("--enable-openapi", is_flag=True, help="Serve the API's OpenAPI 3 schema at GET /openapi.json."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _listed(values: tuple[str, ...], name: str) -> tuple[str, ...]:
    """A repeated option's values, each a JSON list (vLLM's form) or comma-separated."""
    out: list[str] = []
    for value in values:
        if value.lstrip().startswith("["):
            try:
                items = json.loads(value)
            except ValueError as exc:
                raise UserError(f"{name} {value!r}: not a JSON list ({exc})") from None
            if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
                raise UserError(f"{name} {value!r}: expected a JSON list of strings")
            out.extend(items)
        else:
            out.extend(part.strip() for part in value.split(",") if part.strip())
    return tuple(out)


def api_options(allowed_origins: tuple[str, ...], allowed_methods: tuple[str, ...],
                allowed_headers: tuple[str, ...], allow_credentials: bool, lenient_request_fields: bool,
                metrics_names: str, enable_openapi: bool) -> ApiOptions:
    from lmfoundry.runtime.server.app import ApiOptions

    origins = _listed(allowed_origins, "--allowed-origins")
    for origin in origins:
        if origin != "*" and "://" not in origin:
            raise UserError(f"--allowed-origins {origin!r}: an origin is scheme://host[:port] (or '*')")
    if not origins and (allowed_methods or allowed_headers or allow_credentials):
        raise UserError("--allowed-methods, --allowed-headers and --allow-credentials need --allowed-origins")
    if allow_credentials and "*" in origins:  # what ApiOptions refuses too, said with the flags' names
        raise UserError("--allow-credentials with --allowed-origins '*' would let every web page send requests with "
                        "the user's credentials; list the origins explicitly (--allowed-origins https://app.example)")
    return ApiOptions(allowed_origins=origins, allowed_methods=_listed(allowed_methods, "--allowed-methods") or ("*",),
                     allowed_headers=_listed(allowed_headers, "--allowed-headers") or ("*",),
                      allow_credentials=allow_credentials, lenient_request_fields=lenient_request_fields,
                     metrics_names=metrics_names, openapi=enable_openapi)
