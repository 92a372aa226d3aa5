"""Build an engine bundle: plan, cross-compile in worker processes, check the SASS, write files.

Bundle layout:
    engine.json                         manifest: kernels + sha256, archs, toolchain, fusions, source
    weights/                            the checkpoint's files (symlinked, copied, or repacked)
    kernels/<sm>/<key>.cubin|.ptx|.json one compiled specialization and its launch metadata
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lmfoundry.compile import sass, tiles
from lmfoundry.compile.aot import run_jobs
from lmfoundry.compile.checkpoint import Checkpoint, load_checkpoint
from lmfoundry.compile.plan import Plan, make_plan
from lmfoundry.errors import UserError

ENGINE_FORMAT = "lmfoundry-engine/1"
ARCH_ALIASES = {"ampere": 80, "sm_80": 80, "sm80": 80, "a100": 80, "ada": 89, "sm_89": 89, "sm89": 89,
                "l4": 89, "l40s": 89, "hopper": 90, "sm_90": 90, "sm_90a": 90, "sm90": 90, "h100": 90, "h200": 90}
WEIGHT_MODES = ("link", "copy", "repack")


def parse_arch(name: str) -> int:
    try:
        return ARCH_ALIASES[name.strip().lower()]
    except KeyError:
        raise UserError(f"unknown arch {name!r}; choose from ampere (sm_80), ada (sm_89), hopper (sm_90a)") from None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_output(checkpoint: Path) -> Path:
    checkpoint = checkpoint.resolve()
    return checkpoint.parent / f"{checkpoint.name}-engine"


@dataclass
class BuildResult:
    output: Path
    manifest: dict[str, Any]
    seconds: float

    @property
    def kernels(self) -> list[dict[str, Any]]:
        return self.manifest["kernels"]


def _prepare_output(out: Path, checkpoint: Path) -> None:
    if out.resolve() == checkpoint.resolve():
        raise UserError(f"{out}: the engine cannot be written into the checkpoint folder itself")
    if out.exists():
        if not out.is_dir():
            raise UserError(f"{out}: exists and is not a folder")
        if any(out.iterdir()) and not (out / "engine.json").exists():
            raise UserError(f"{out}: exists, is not empty and is not an engine bundle; choose another -o")
        for sub in ("kernels", "weights"):
            if (out / sub).is_symlink() or (out / sub).is_file():
                (out / sub).unlink()
            elif (out / sub).exists():
                shutil.rmtree(out / sub)
        (out / "engine.json").unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)


def _place_weights(ck: Checkpoint, plan: Plan, out: Path, mode: str) -> dict[str, Any]:
    dst = out / "weights"
    dst.mkdir()
    files = sorted(p for p in ck.path.iterdir() if p.is_file())
    record: dict[str, Any] = {"mode": mode, "files": {}}
    if mode == "repack" and ck.has_weights():
        from lmfoundry.compile.repack import repack

        record["fused_tensors"] = repack(ck, plan, dst / "model.safetensors")
        files = [p for p in files if p.suffix != ".safetensors" and p.name != "model.safetensors.index.json"]
        record["files"]["model.safetensors"] = {"bytes": (dst / "model.safetensors").stat().st_size,
                                                "sha256": sha256_file(dst / "model.safetensors")}
    for src in files:
        target = dst / src.name
        if mode == "link":
            os.symlink(src.resolve(), target)
            record["files"][src.name] = {"bytes": src.stat().st_size, "link": str(src.resolve())}
        else:
            shutil.copy2(src, target)
            record["files"][src.name] = {"bytes": target.stat().st_size, "sha256": sha256_file(target)}
    return record


def build_engine(
    checkpoint: str | Path,
    archs: list[str],
    output: str | Path | None = None,
    *,
    weights: str = "link",
    workers: int = 2,
    block_size: int = 16,
    dtype: str | None = None,
    tune: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = lambda msg: None,
) -> BuildResult:
    """Compile every kernel `checkpoint` needs for `archs` into an engine bundle at `output`."""
    t0 = time.perf_counter()
    if not archs:
        raise UserError("name at least one --arch (ampere, ada, hopper)")
    if weights not in WEIGHT_MODES:
        raise UserError(f"--weights must be one of {', '.join(WEIGHT_MODES)}")
    caps = list(dict.fromkeys(parse_arch(a) for a in archs))
    src = Path(checkpoint)
    ck = load_checkpoint(src, dtype)
    plan = make_plan(ck, caps, block_size)
    if tune:
        from lmfoundry.compile.tune import tune_plan

        tune_plan(plan, log)
    out = Path(output) if output is not None else default_output(src)
    _prepare_output(out, src)

    jobs = []
    for i, spec in enumerate(plan.specs):
        jobs.append({"id": i, "key": spec.key(), "capability": spec.capability, "sm": spec.sm, "kernel": spec.kernel,
                     "types": spec.types, "semantics": spec.semantics, "config": spec.config.as_dict(),
                     "aligned": spec.aligned, "out_dir": str(out / "kernels" / spec.sm)})
    log(f"{len(jobs)} kernel specializations for {', '.join(tiles.SM_NAME[c] for c in caps)}")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(jobs), desc="compile", unit="kernel", leave=False)
    with tempfile.TemporaryDirectory(prefix="lmfoundry-triton-") as cache:
        try:
            replies = run_jobs(jobs, workers, Path(cache) / "triton", out / "compile.log",
                               on_done=(lambda r: bar.update(1)) if bar is not None else (lambda r: None))
        finally:
            if bar is not None:
                bar.close()
    failed = [(j, r) for j, r in zip(jobs, replies) if not r.get("ok")]
    if failed:
        j, r = failed[0]
        raise UserError(f"{len(failed)} kernels failed to compile; first: {j['kernel']} for {j['sm']}: "
                        f"{r.get('error', '?').splitlines()[0]} (details: {out / 'compile.log'})", exit_code=3)
    for spec, reply in zip(plan.specs, replies):
        sass.check(spec.kernel, spec.sm, spec.expected_sass(), reply["mma"])
    (out / "compile.log").unlink(missing_ok=True)

    kernels = []
    for spec, job, reply in zip(plan.specs, jobs, replies):
        rel = Path("kernels") / spec.sm / spec.key()
        files = {ext: str(rel.with_suffix(f".{ext}")) for ext in ("cubin", "ptx", "json")}
        kernels.append({
            "key": spec.key(),
            "kernel": spec.kernel,
            "arch": tiles.ARCH_OF_CAPABILITY[spec.capability],
            "sm": spec.sm,
            "capability": spec.capability,
            "types": spec.types,
            "semantics": spec.semantics,
            "config": spec.config.as_dict(),
            "aligned": spec.aligned,
            "covers": spec.covers,
            "files": files,
            "sha256": {ext: sha256_file(out / f) for ext, f in files.items()},
            "sass": {"mma": reply["mma"], "expected_any_of": list(spec.expected_sass())},
            "shared": reply["shared"],
            "num_warps": reply["num_warps"],
            "triton": reply["versions"]["triton"],
            "ptxas": reply["versions"]["ptxas"],
        })
    versions = replies[0]["versions"] if replies else {}
    cfg = ck.config
    manifest = {
        "format": ENGINE_FORMAT,
        "source": {"path": str(src.resolve()), "config_sha256": ck.config_sha256,
                   "quantization_format": ck.quant_format},
        "model": {"model_type": cfg.model_type, "dtype": plan.dtype, "hidden_size": cfg.hidden_size,
                  "intermediate_size": cfg.intermediate_size, "num_layers": cfg.num_layers,
                  "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                  "vocab_size": cfg.vocab_size},
        "linears": {g.name: {"n": g.n, "k": g.k, "scheme": g.scheme.describe(), "kind": g.scheme.kind,
                             "bias": g.bias} for g in plan.gemms},
        "kv_cache": {"dtype": ck.kv.dtype, "kernel_type": plan.kv_dtype, "block_size": plan.block_size,
                     "strategy": ck.kv.strategy},
        "archs": {tiles.ARCH_OF_CAPABILITY[c]: {"capability": c, "sm": tiles.SM_NAME[c]} for c in caps},
        "toolchain": {"triton": versions.get("triton"), "ptxas": versions.get("ptxas"), "cuda": versions.get("cuda"),
                      "line_info": False},
        "fusions": [f.as_dict() for f in plan.fusions],
        "weights": _place_weights(ck, plan, out, weights),
        "kernels": kernels,
        "build": {"seconds": round(time.perf_counter() - t0, 2), "workers": workers, "tuned": tune},
    }
    (out / "engine.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return BuildResult(out, manifest, time.perf_counter() - t0)
