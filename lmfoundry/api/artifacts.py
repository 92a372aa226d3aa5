"""What the API hands back for a folder on disk: `Checkpoint` (a quantized checkpoint with its
lmfoundry.json) and `Bundle` (an engine bundle with its engine.json), and `inspect`, which opens
either and verifies every file's sha256. `lmfoundry inspect` prints what `inspect` returns.

Both are small frozen records of plain values (path, manifest dict, scheme summary, the inspect
table), not framework objects: a CI script can log, compare or JSON-dump them, and nothing stays
open behind them.

The manifest is untrusted input (an artifact may be downloaded): `read_manifest` bounds and
type-checks it, `verify_files` keeps every path it names inside the folder, and the summary reads
each field defensively, so a malformed manifest is one `LmfoundryError` line or a "?" in the
table, never a traceback. What the run measured (time, peak RSS, device) is read from the run
record beside the manifest (`lmfoundry-run.json`, not hashed; see `lmfoundry.manifest`), or from
the manifest of an artifact written before the two were split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmfoundry.errors import UserError


@dataclass(frozen=True)
class Checkpoint:
    """A quantized checkpoint folder (compressed-tensors, loadable by vLLM and transformers).

    `manifest` is its lmfoundry.json as read; `scheme` the quantization in a few plain values
    (method, scheme, group size, per-channel, KV cache, format); `summary` the rows `lmfoundry
    inspect` prints. `problems` is what the last verification found (each file that does not match
    its sha256; empty: all match), or None where the folder was not re-read: `quantize` returns
    the checkpoint it just hashed while writing; call `verify()` to check it again."""

    path: Path
    manifest: dict[str, Any]
    scheme: dict[str, Any]
    summary: dict[str, Any] = field(default_factory=dict)
    problems: tuple[str, ...] | None = None

    @property
    def verified(self) -> bool | None:
        """True when every file matched at the last verification, None when not verified."""
        return None if self.problems is None else not self.problems

    def verify(self) -> tuple[str, ...]:
        """Hash every file again against lmfoundry.json now; the problems found (empty: intact)."""
        from lmfoundry.manifest import read_manifest, verify_files

        return tuple(verify_files(self.path, read_manifest(self.path)))


@dataclass(frozen=True)
class Bundle:
    """An engine bundle folder (`lmfoundry compile`'s output: kernels or a compiled CPU step, and
    the weights they read), which `serve` and `LLM` run.

    `manifest` is its engine.json (rank 0's for a tensor-parallel bundle, whose every rank's
    manifest is in `rank_manifests`); `scheme` what it was built for (target, archs, dtype, tensor
    parallel degree); `summary` the rows `lmfoundry inspect` prints; `problems` as in `Checkpoint`;
    `seconds` the build time when `compile` returned it."""

    path: Path
    manifest: dict[str, Any]
    scheme: dict[str, Any]
    summary: dict[str, Any] = field(default_factory=dict)
    problems: tuple[str, ...] | None = None
    rank_manifests: tuple[dict[str, Any], ...] = ()
    seconds: float | None = None

    @property
    def verified(self) -> bool | None:
        """True when every file matched at the last verification, None when not verified."""
        return None if self.problems is None else not self.problems

    @property
    def kernels(self) -> list[dict[str, Any]]:
        """Every compiled kernel specialization, over all ranks (empty for an `--arch cpu` bundle)."""
        return [k for m in (self.rank_manifests or (self.manifest,)) for k in _list(m, "kernels")]

    @property
    def fusions(self) -> list[str]:
        """The GEMM fusions applied (q/k/v, gate/up)."""
        return [f["name"] for f in _list(self.manifest, "fusions") if isinstance(f, dict) and f.get("applied")]

    def verify(self) -> tuple[str, ...]:
        """Hash every file again against engine.json now; the problems found (empty: intact)."""
        return open_bundle(self.path, verify=True).problems or ()


def artifact_path(artifact: str | Path | Checkpoint | Bundle) -> str:
    """What a model argument names on disk: a path or name as given, or an API record's folder."""
    return str(artifact.path if isinstance(artifact, (Checkpoint, Bundle)) else artifact)


def inspect(path: str | Path | Checkpoint | Bundle) -> Checkpoint | Bundle:
    """Open the artifact at `path`, a quantized checkpoint or an engine bundle (or the folder of
    one the API returned), and verify every file's sha256 against its manifest. A file that does not match is reported in `problems`
    (not raised: inspecting a damaged artifact is how one finds what is damaged); a folder that
    is neither, or whose manifest is malformed, raises `LmfoundryError`."""
    from lmfoundry.engine_bundle.engine_manifest import is_engine_bundle

    folder = Path(artifact_path(path))
    if not folder.is_dir():
        raise UserError(f"{path}: no such folder")
    if is_engine_bundle(folder) and not (folder / "lmfoundry.json").exists():
        return open_bundle(folder, verify=True)
    return open_checkpoint(folder, verify=True)


def open_checkpoint(path: Path, verify: bool) -> Checkpoint:
    """The checkpoint at `path`, its files hashed against the manifest when `verify`."""
    from lmfoundry.manifest import read_manifest, verify_files

    manifest = read_manifest(path)
    problems = tuple(verify_files(path, manifest)) if verify else None
    q = _dict(_dict(manifest, "recipe"), "quantize")
    scheme = {"method": q.get("method"), "scheme": q.get("scheme"), "group_size": q.get("group_size"),
              "per_channel": q.get("per_channel"), "kv_cache": q.get("kv_cache"),
              "format": manifest.get("quantization_config_format")}
    return Checkpoint(Path(path), manifest, scheme, checkpoint_summary(Path(path), manifest), problems)


def open_bundle(path: Path, verify: bool) -> Bundle:
    """The engine bundle at `path` (every rank's of a tensor-parallel one, each rank's
    engine.json against the top one); its files hashed against engine.json when `verify`."""
    from lmfoundry.engine_bundle.engine_manifest import bundle_degree, bundle_problems, rank_bundle, read_manifest

    degree = bundle_degree(path)
    problems: list[str] = []
    ranks: list[dict[str, Any]] = []
    if degree > 1:
        for r in range(degree):
            try:
                folder = rank_bundle(path, r)
            except UserError as exc:
                problems.append(str(exc))
                continue
            ranks.append(read_manifest(folder))
            if verify:
                problems += [f"rank{r}: {p}" for p in bundle_problems(folder, ranks[-1])]
        if not ranks:
            raise UserError(f"{path}: no rank bundle matches engine.json")
        m = ranks[0]
    else:
        m = read_manifest(path)
        if verify:
            problems = bundle_problems(path, m)
    model = _dict(m, "model")
    source = _dict(m, "source")
    summary: dict[str, Any] = {"engine": str(path), "model": _text(model.get("model_type")),
                               "dtype": _text(model.get("dtype")), "source": _text(source.get("name") or source.get("path"))}
    if degree > 1:
        summary["tensor_parallel"] = f"{degree} ranks (rank0/ .. rank{degree - 1}/)"
    target = "cpu" if m.get("target") == "cpu" else "gpu"
    if target == "cpu":
        cpu = _dict(m, "cpu")
        summary.update(target="cpu", isa=_text(cpu.get("isa")), torch=_text(cpu.get("torch")),
                       step=_text(_dict(cpu, "step").get("path")), max_tokens=_text(cpu.get("max_tokens")))
    else:
        summary.update(target="gpu", archs=", ".join(sorted(_dict(m, "archs"))),
                       kernels=sum(len(_list(r, "kernels")) for r in ranks or [m]))
    files = sum(len(_dict(r, "weights").get("files") or ()) for r in ranks or [m])
    summary["weights"] = f"{_text(_dict(m, 'weights').get('mode'))}, {files} files"
    scheme = {"target": target, "archs": sorted(_dict(m, "archs")), "dtype": model.get("dtype"),
              "tensor_parallel": degree, "weights": _dict(m, "weights").get("mode")}
    return Bundle(Path(path), m, scheme, summary, tuple(problems) if verify else None, tuple(ranks) if degree > 1 else ())


def _dict(d: Any, key: str) -> dict:
    """`d[key]` when both are mappings, else {} (a manifest field of the wrong type reads as absent)."""
    value = d.get(key) if isinstance(d, dict) else None
    return value if isinstance(value, dict) else {}


def _list(d: Any, key: str) -> list:
    """`d[key]` when it is a list, else [] (as `_dict`)."""
    value = d.get(key) if isinstance(d, dict) else None
    return value if isinstance(value, list) else []


def _num(value: Any) -> float | None:
    """A finite number from a manifest field, else None (strings, booleans, NaN are not metrics)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _text(value: Any, limit: int = 200) -> str:
    """A manifest value as one bounded line: scalars as text, containers by their type name (a
    hostile manifest can neither flood the terminal nor nest deep enough to break `repr`)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        s = " ".join(str(value).split())
    else:
        s = f"<{type(value).__name__}>"
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _run_record(path: Path, m: dict[str, Any]) -> dict[str, Any]:
    """The run record's fields, else the manifest's (an artifact from before the run record);
    an unreadable run record reads as absent ("?" in the table): it is not part of the artifact."""
    from lmfoundry.manifest import read_run_record

    try:
        run = read_run_record(path)
    except UserError:
        return {}
    return m if run is None else run


def _source_model(src: dict[str, Any]) -> str:
    """The source model as the manifest names it: a built-in name, a GGUF file, or its weights
    files (an old manifest's `spec` is shown as it was given)."""
    if "spec" in src:
        return _text(src["spec"])
    if "file" in src:
        return f"{_text(src['file'])} (sha256 {_text(src.get('file_sha256'))[:16]})"
    files = _dict(src, "sha256")
    if not files:
        return "?"
    return f"{len(files)} weights file(s), config sha256 {_text(src.get('config_sha256'))[:16]}"


def checkpoint_summary(path: Path, m: dict[str, Any]) -> dict[str, Any]:
    """The rows `lmfoundry inspect` prints for a checkpoint: recipe, scheme, source, calibration,
    errors, the run's time and memory, the tools, the promotion verdict."""
    q = _dict(_dict(m, "recipe"), "quantize")
    cal = _dict(m, "calibration")
    layers = {k: v for k, v in _dict(m, "layers").items() if isinstance(v, dict)}
    errs = [e for layer in layers.values() for v in layer.values() if isinstance(v, dict)
            if (e := _num(v.get("weight_rel_error"))) is not None]
    out_errs = [e for layer in layers.values() if (e := _num(layer.get("output_rel_error"))) is not None]
    run = _run_record(path, m)
    peak, wall = _num(run.get("peak_rss_bytes")), _num(run.get("wall_s"))
    warnings = m.get("warnings")
    tools = _dict(m, "tool_versions")
    summary = {
        "artifact": str(path),
        "kind": _text(m.get("kind", "?")),
        "method": _text(q.get("method", "?")),
        "scheme": f"{_text(q.get('scheme'))} group={_text(q.get('group_size'))} "
                  f"per_channel={_text(q.get('per_channel'))} kv={_text(q.get('kv_cache'))}",
        "format": _text(m.get("quantization_config_format", "?")),
        "source model": _source_model(_dict(m, "source_model")),
        "calibration": f"{_text(cal.get('num_samples'))}x{_text(cal.get('seq_len'))} tokens of "
                       f"{_text(Path(_text(cal.get('source', '?'))).name)} (token sha256 "
                       f"{_text(cal.get('token_ids_sha256', ''))[:16]}, used={_text(cal.get('used'))})",
        "mean weight rel error": f"{sum(errs) / len(errs):.4f} over {len(errs)} linears" if errs else "n/a",
        "mean layer out error": f"{sum(out_errs) / len(out_errs):.4f}" if out_errs else
                                "n/a (not measured: a data-free method, or GPTQ's one-pass calibration)",
        "warnings": len(warnings) if isinstance(warnings, list) else 0,
        "peak RSS": f"{peak / 2**20:.0f} MiB" if peak is not None else "?",
        "run": f"{wall:.1f} s on {_text(run.get('device'))}" if wall is not None else "?",
        "tools": _text(", ".join(f"{_text(k)} {_text(v)}" for k, v in tools.items() if v != "not installed"), 400),
    }
    if "promotion" in m:
        summary["promotion"] = _text(_dict(m, "promotion").get("verdict", "?"))
    return summary
