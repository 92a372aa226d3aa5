"""`lmfoundry quantize`: calibrate a model layer by layer and write a compressed-tensors checkpoint.

The output folder is checked before any model work (`check_output`): `--overwrite` replaces only
an lmfoundry artifact (a folder holding lmfoundry.json and nothing the manifest does not list) or
an empty folder, never a folder of someone else's files, and a folder we cannot write to is one
`error:` line up front instead of a traceback after calibration. The old artifact is moved aside
and only deleted once the new one is in place, and parent folders created for the output are
removed again when the run fails, so a failure leaves the disk as it was.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import click

from lmfoundry.errors import UserError
from lmfoundry.quantization_plan import KV_CHOICES, build_plan


class WholeNumber(click.ParamType):
    """An integer option within [low, high], refused with one `error:` line (a UserError) rather
    than click's usage block: `--seed 1e23` or `--num-samples 1.5` are user mistakes like any
    other, and a seed beyond 64 bits used to pass parsing and crash in torch."""

    name = "integer"

    def __init__(self, low: int, high: int | None = None) -> None:
        self.low, self.high = low, high

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        flag = param.opts[0] if param is not None and param.opts else "value"
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            try:
                number = int(str(value).strip(), 10)
            except ValueError:
                number = None
        if number is None or number < self.low or (self.high is not None and number > self.high):
            bound = f"from {self.low} to {self.high}" if self.high is not None else f">= {self.low}"
            raise UserError(f"{flag} {value}: expected a whole number {bound}")
        return number


RECIPE_OPTIONS = [
    click.option("--recipe", default=None, help="Recipe YAML (path, or name of one in recipes/). Flags override it."),
    click.option("--method", type=click.Choice(["rtn", "gptq", "awq", "smoothquant", "fp8"]), default=None,
                 help="Quantization algorithm. [recipe default: rtn]"),
    click.option("--scheme", default=None, help="wNa16 (N=2..8: w4a16, w8a16), w8a8 (dynamic per-token int8 "
                 "activations), w8a8-static, fp8-dynamic, fp8-static. [w4a16]"),
    click.option("--group-size", type=WholeNumber(1), default=None, help="Weight group size for wNa16 (default 128)."),
    click.option("--per-channel", is_flag=True, default=None, help="One scale per output channel instead of groups."),
    click.option("--sym/--asym", "symmetric", default=None, help="Symmetric (default) or asymmetric weights."),
    click.option("--observer", type=click.Choice(["minmax", "mse"]), default=None, help="Weight range statistic."),
    click.option("--actorder", type=click.Choice(["static", "dynamic"]), default=None, help="GPTQ activation order."),
    click.option("--kv-cache", type=click.Choice(KV_CHOICES), default=None, help="Also quantize the KV cache."),
    click.option("--calib", default=None, help="Calibration text/JSONL/datasets folder or built-in name. [c4]"),
    click.option("--num-samples", type=WholeNumber(1), default=None, help="Calibration samples. [128]"),
    click.option("--seq-len", type=WholeNumber(1), default=None, help="Tokens per calibration sample. [512]"),
    click.option("--seed", type=WholeNumber(0, 2**64 - 1), default=None, help="Sampling seed. [0]"),
    click.option("--propagate", type=click.Choice(["quantized", "float"]), default=None,
                 help="Feed the next layer the quantized (default) or the float layer's outputs."),
    click.option("--moe-experts", type=click.Choice(["all", "routed"]), default=None,
                 help="MoE models: every expert calibrates on all tokens (default; rarely chosen experts get "
                      "statistics) or on the tokens routed to it (an expert no token chose still sees all)."),
    click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default=None,
                 help="Storage dtype of scales and unquantized tensors (auto = the source's)."),
    click.option("--option", "options", multiple=True, metavar="KEY=VALUE",
                 help="Method option, e.g. dampening_frac=0.01 (gptq) or alpha=0.5 (smoothquant)."),
    click.option("--allow-pickle", is_flag=True, help="Convert pickle (*.bin) weights; pickle can run code."),
]


def recipe_options(f: Any) -> Any:
    """The recipe-shaping options shared by `quantize` and `doctor`."""
    for opt in reversed(RECIPE_OPTIONS):
        f = opt(f)
    return f


def recipe_from_cli(recipe: str | None, method: str | None = None, scheme: str | None = None,
                    group_size: int | None = None, per_channel: bool | None = None, symmetric: bool | None = None,
                    observer: str | None = None, actorder: str | None = None, kv_cache: str | None = None,
                    calib: str | None = None, num_samples: int | None = None, seq_len: int | None = None,
                    seed: int | None = None, propagate: str | None = None, dtype: str | None = None,
                    options: tuple[str, ...] = (), moe_experts: str | None = None, **_: Any) -> dict[str, Any]:
    """The recipe as applied: the YAML (or defaults) with every given flag overriding it, checked
    again after the overrides (a `--option` value or a flag may be what makes it invalid)."""
    from lmfoundry.recipe import apply_overrides, check_recipe, load_recipe

    rec = load_recipe(recipe)
    apply_overrides(rec, "quantize", method=method, scheme=scheme, group_size=group_size,
                    per_channel=per_channel or None, symmetric=symmetric, observer=observer,
                    actorder=actorder, kv_cache=kv_cache, dtype=dtype)
    if options:
        rec["quantize"]["options"] = {**rec["quantize"]["options"], **parse_options(options)}
    apply_overrides(rec, "calibration", source=calib, num_samples=num_samples, seq_len=seq_len,
                    seed=seed, propagate=propagate, moe_experts=moe_experts)
    return check_recipe(rec, "recipe (with the command-line flags)")


@click.command("quantize")
@click.argument("model")
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False), help="Output folder.")
@recipe_options
@click.option("--overwrite", is_flag=True, help="Replace a non-empty output folder.")
@click.option("--skip-doctor", is_flag=True, help="Do not run the pre-flight checks.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("--resume", is_flag=True,
              help="Continue a run of the same inputs that was killed (SIGKILL, out of memory, preemption) "
                   "from the last layer it finished, writing the same bytes; its journal lives in the hidden "
                   "`.OUTPUT.partial-PID` folder next to the output.")
@click.option("--device", default="auto", show_default=True,
              help="Where layers, calibration activations and statistics (Hessians) live: cpu, cuda[:N], or "
                   "auto (the GPU if there is one). Weights stream from the safetensors to the device one layer "
                   "at a time; shards stream back to disk.")
@click.option("--offload", type=click.Choice(["auto", "yes", "no"]), default="auto", show_default=True,
              help="Keep calibration activations in pinned host memory between uses (GPU runs whose activations "
                   "do not fit beside a layer); auto decides from free GPU memory, as `doctor` reports.")
def quantize(model: str, output: str, overwrite: bool, skip_doctor: bool, quiet: bool, resume: bool,
             device: str, offload: str, **flags: Any) -> None:
    """Quantize MODEL (a HF folder, a .gguf file, or `smollm2-135m`) into a checkpoint that vLLM,
    SGLang and transformers load (compressed-tensors), plus lmfoundry.json (recipe, versions,
    hashes, per-layer errors). Prints the peak RSS at the end.

    Data-parallel calibration: `torchrun --nproc-per-node N --no-python lmfoundry quantize ...`
    shares the calibration samples among N processes (gloo on CPU, NCCL on GPU, one GPU each),
    sums their statistics before every quantization step, and rank 0 writes the checkpoint."""
    rec = recipe_from_cli(**flags)
    summary = run_quantize(model, Path(output), rec, overwrite=overwrite, allow_pickle=flags["allow_pickle"],
                           doctor=not skip_doctor, progress=not quiet, resume=resume, device=device,
                           offload=offload)
    if summary:
        click.echo(summary)


def parse_options(items: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"--option {item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def run_quantize(model: str, output: Path, rec: dict[str, Any], overwrite: bool = False,
                 allow_pickle: bool = False, doctor: bool = True, progress: bool = True, resume: bool = False,
                 device: str = "cpu", offload: str = "auto") -> str:
    """The whole quantize job; returns the summary text (empty on data-parallel ranks other than
    0, which write nothing). Raises UserError before any output on bad input, and leaves the disk
    as it found it on any failure: the checkpoint is built in a hidden staging folder next to the
    output, swapped in at the end, and the staging folder and any parent folders created for the
    output are removed when the job fails."""
    from lmfoundry.distributed import init_from_environment, shutdown
    from lmfoundry.recipe import check_recipe
    from lmfoundry.runtime.loader import check_device

    check_recipe(rec)
    if offload not in ("auto", "yes", "no"):
        raise UserError(f"--offload {offload!r}: expected auto, yes or no")
    dev = _compute_device(check_device(device))
    group = init_from_environment(dev)
    try:
        if not group.writer:
            return _quantize_into(model, None, None, rec, overwrite, allow_pickle, doctor, False, resume,
                                  dev, offload)
        return _run_writer(model, output, rec, overwrite, allow_pickle, doctor, progress, resume, dev, offload)
    finally:
        shutdown()


def _compute_device(spec: str) -> Any:
    """The torch device of this process: under torchrun with CUDA, the GPU of LOCAL_RANK."""
    import torch

    from lmfoundry.distributed import launched_world_size

    dev = torch.device(spec)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) if launched_world_size() > 1 else 0)
    return dev


def _run_writer(model: str, output: Path, rec: dict[str, Any], overwrite: bool, allow_pickle: bool,
                doctor: bool, progress: bool, resume: bool, device: Any, offload: str) -> str:
    """`run_quantize` on the writing process (the only one, or rank 0)."""
    out = check_output(output, overwrite)
    created = _make_parents(out)
    staging: Path | None = None
    try:
        staging = _staging_folder(out)
        summary = _quantize_into(model, out, staging, rec, overwrite, allow_pickle, doctor, progress, resume,
                                 device, offload)
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


def _quantize_into(model: str, out: Path | None, staging: Path | None, rec: dict[str, Any], overwrite: bool,
                   allow_pickle: bool, doctor: bool, progress: bool, resume: bool = False,
                   device: Any = "cpu", offload: str = "auto") -> str:
    """`run_quantize` after the output checks: build the checkpoint in `staging`, then swap it in.
    A data-parallel rank other than 0 (out and staging None) runs the same steps on its share of
    the calibration data, in the work folder rank 0 names, and writes no checkpoint."""
    import torch

    from lmfoundry.calibration.data import load_calibration
    from lmfoundry.calibration.journal import LayerJournal, run_key
    from lmfoundry.calibration.memory import activations_offload
    from lmfoundry.calibration.pipeline import check_plan, check_tensors_match_config, current_rss_bytes, run_pipeline
    from lmfoundry.distributed import ranks
    from lmfoundry.checkpoint import TOKENIZER_FILES, CheckpointReader, CheckpointWriter, quantized_config
    from lmfoundry.manifest import sha256_file, tool_versions
    from lmfoundry.models import resolve_model, safetensors_files
    from lmfoundry.quantizers.base import get_quantizer
    from lmfoundry.model.config import ROUTER_IGNORE, ModelConfig
    from lmfoundry.runtime.loader import load_tokenizer

    # loaded before the baseline: start-up, not model work (compressed-tensors, which the doctor
    # and the writer's config use, pulls in transformers' modules and pydantic: ~250 MB of RSS)
    import compressed_tensors  # noqa: F401
    import transformers  # noqa: F401

    t0 = time.time()
    baseline_rss = current_rss_bytes()
    q, c = rec["quantize"], rec["calibration"]
    plan = build_plan(q)
    quantizer = get_quantizer(q["method"], q.get("options"))
    for g in plan.groups:
        quantizer.validate(g.scheme)
    folder = resolve_model(model, allow_pickle=allow_pickle)
    reader = CheckpointReader(folder)
    if reader.plan is not None:
        raise UserError(f"{folder}: already quantized; quantize a float model")
    config = ModelConfig.from_dict(reader.config)
    check_tensors_match_config(reader, config)
    if config.is_moe:  # the router stays float, and every loader is told so
        plan.ignore += [p for p in ROUTER_IGNORE if p not in plan.ignore]
    check_plan(plan, config)
    if doctor:
        _preflight(str(folder), rec)  # the resolved folder: no second conversion or opt-in
    out_dtype = reader.dtype if q["dtype"] in (None, "auto") else getattr(torch, q["dtype"])
    tokenizer = load_tokenizer(folder)
    calib = load_calibration(c["source"], tokenizer, int(c["num_samples"]), int(c["seq_len"]), int(c["seed"]))
    extra = []
    if plan.kv_cache is not None:
        from lmfoundry.quantizers.kv_cache import kv_calibration_pass

        extra.append(kv_calibration_pass(plan.kv_cache, out_dtype))
    needs_data = quantizer.needs_calibration or bool(extra)

    shards = safetensors_files(folder)
    source_files = {f.name: [(st := f.stat()).st_size, st.st_mtime_ns] for f in shards}
    key = run_key({"recipe": {k: v for k, v in rec.items() if k != "source_file"}, "source": source_files,
                   "config_sha256": sha256_file(folder / "config.json"), "calibration": calib.describe(),
                   "dtype": str(out_dtype), "versions": tool_versions()})
    group = ranks()
    key = run_key({"run": key, "world_size": group.world_size})  # each rank journals its own share
    device = torch.device(device)
    batch_size = int(c.get("batch_size", 8))
    move_out = needs_data and activations_offload(config, -(-int(c["num_samples"]) // group.world_size),
                                                  int(c["seq_len"]), batch_size, device, offload, q["method"])
    pipeline_args = dict(propagate=c["propagate"], batch_size=batch_size, extra_layer_passes=extra,
                         device=device, offload=move_out, experts=c.get("moe_experts", "all"))
    calib_ids = calib.token_ids if needs_data else None
    if out is None:  # a data-parallel rank other than 0: rank 0's work folder and journal position
        work_name, done = group.broadcast(None)
        journal = LayerJournal(Path(work_name), key, done=done)
        run_pipeline(reader, config, plan, quantizer, None, calib_ids, out_dtype, progress=False,
                     journal=journal, **pipeline_args)
        return ""
    work, journal = _work_folder(out, key, resume)
    group.broadcast((str(work), journal.done))
    try:
        with CheckpointWriter(staging, work=work) as writer:
            resumed_at = journal.done
            report = run_pipeline(reader, config, plan, quantizer, writer, calib_ids, out_dtype,
                                  progress=progress, journal=journal, **pipeline_args)
            journal.close()
            writer.copy_files(folder, TOKENIZER_FILES)
            source_hashes = {f.name: sha256_file(f) for f in shards}
            manifest = {
                "kind": "quantized-checkpoint",
                "created_unix": int(time.time()),
                "tool_versions": tool_versions(),
                "recipe": {k: v for k, v in rec.items() if k != "source_file"},
                "recipe_file": rec.get("source_file"),
                "source_model": {"spec": model, "path": str(folder), "sha256": source_hashes,
                                 "config_sha256": sha256_file(folder / "config.json")},
                "calibration": {**calib.describe(), "used": needs_data},
                "quantization_config_format": plan.format(),
                "layers": report.layers,
                "layer_seconds": report.layer_seconds,
                "warnings": report.warnings + _loader_notes(plan),
                "peak_rss_bytes": report.peak_rss_bytes,
                "baseline_rss_bytes": baseline_rss,
                "device": str(device), "activations_offloaded": move_out,
                "data_parallel": {"world_size": group.world_size, "backend": group.backend},
                "wall_s": round(time.time() - t0, 2),
                "resumed_from_layer": resumed_at,
            }
            writer.finish(quantized_config(reader.config, plan, out_dtype), manifest)
        _swap_into_place(staging, out, overwrite)
    except OSError as exc:
        if exc.errno not in _WRITE_ERRNOS:
            raise
        raise UserError(f"{out}: cannot write the checkpoint ({exc.strerror or exc})") from None
    errs = [m.get("weight_rel_error") for layer in report.layers.values() for m in layer.values()
            if isinstance(m, dict) and m.get("weight_rel_error") is not None]
    mean_err = sum(errs) / len(errs) if errs else float("nan")
    lines = [
        f"wrote {out} ({plan.format()}, {q['method']} {plan.groups[0].scheme.weights.describe()}"
        f"{', kv ' + q['kv_cache'] if q.get('kv_cache') else ''})",
        f"mean relative weight error {mean_err:.4f} over {len(errs)} linears; {len(report.warnings)} warning(s)",
        f"time {time.time() - t0:.1f} s; peak RSS {report.peak_rss_bytes / 2**20:.0f} MiB "
        f"(process baseline {baseline_rss / 2**20:.0f} MiB)",
    ]
    return "\n".join(lines)


def _loader_notes(plan) -> list[str]:
    """Known limits of other loaders for this checkpoint (recorded so users are not surprised)."""
    notes = []
    for g in plan.groups:
        w = g.scheme.weights
        if g.scheme.format == "pack-quantized" and not w.symmetric:
            notes.append("asymmetric pack-quantized: vLLM loads the packed zero points; transformers 5.x "
                         "re-initializes them (upstream llm-compressor#1618) - use our runtime or vLLM")
    return notes


def _preflight(model: str, rec: dict[str, Any]) -> None:
    """Run the doctor's blocking checks."""
    from lmfoundry.doctor import preflight

    preflight(model, rec)
