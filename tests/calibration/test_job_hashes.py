"""Bit-identical checkpoints across the quantize-job refactor (issue #26): the recipe became typed
dataclasses and the run moved from `lmfoundry/commands/quantize.py` into `calibration/job.py`.

The hashes below were recorded from the code *before* that refactor, by running these same
command lines; the test guards that the checkpoint bytes (every *.safetensors file and
config.json) stay identical. Of lmfoundry.json the recipe, recipe file and calibration records
are hashed as written: they hold no local path (issue #57), so neither the temporary folders nor
LMFOUNDRY_CACHE (where the built-in calibration text lies) enter them. The rest of it holds tool
versions and per-layer errors, which follow the installation and the CPU. The tiny model and the
calibration text are seeded, so the bytes are stable run to run. A deliberate change of the output
format updates the table (and says so in the commit): issue #57 changed the three manifest
records (names instead of paths).

What depends on the CPU (issue #50). RTN and FP8 of given weights are elementwise arithmetic and
exact reductions (absmax): the same bytes on every CPU, held byte for byte everywhere (EXPECTED).
A calibrated output is a float sum over activations, which each CPU path rounds in its own order:
GPTQ's Hessian and Cholesky factor (MKL), its column updates (OpenBLAS), and where bf16 is native
the attention each K/V row receives (oneDNN's AVX512-BF16 or AMX kernels); the KV-cache scales
(absmax of K and V after MKL's products). A value at a rounding boundary flips, and GPTQ carries a
flipped code on through its updates. So the layer shards of those cases (ISA_DEPENDENT) are
recorded per CPU path (`isa()` of `lmfoundry.runtime.cpu.isa`, one thread as `make test` runs),
each recording with the CPU models (`machine()`) that gave it: two CPUs of one path can still
round differently (MKL keeps a path of its own on non-Intel CPUs; block sizes follow the caches).
- A recording that lists this CPU: byte for byte.
- Else a recording of this path that matches (another model gave the same bytes): passes.
- None that matches: the bytes are reported (a `NewRecording` warning that names the entry to add
  to ISA_BYTES), not failed.
Recorded or not, the same outputs are held to bounds from the math
(`test_calibrated_outputs_within_bounds`), which a changed algorithm fails on any CPU; and
`test_every_cpu_path` (slow) runs this module under each path the CPU has (`LMFOUNDRY_CPU_ISA`)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Callable

import pytest
import torch
from helpers import tiny_model_folder, write_text
from safetensors.torch import load_file

from lmfoundry.runtime.cpu.isa import ENV, isa, machine, supported

# recorded from the code before the refactor (see the module docstring)
EXPECTED: dict[str, dict[str, str]] = {
    "fp8-dynamic": {
        "model-00001-of-00004.safetensors":
            "805cf5d8d36371e90aa991f55a9b6597a0e8ff1668a1e079ff71f8375d1a7837",
        "model-00002-of-00004.safetensors":
            "9efac2b3bd50b22ae2c43bd736b03aa8b5b8e6c155d303624507def182f9d974",
        "model-00003-of-00004.safetensors":
            "fde462883b20754bfd455a0faea41d0ac993bd0897c4690812ad47f8262c41cc",
        "model-00004-of-00004.safetensors":
            "3445777c7c49c2ba6f575c7828904594b49cae1426f3a4e3bbde75b25b1f2ac8",
        "config.json":
            "b451794de26b68dadab45421658e65746c9e05583e8d6c4b5e66ca4b26caa40d",
        "lmfoundry.json:recipe":
            "4160a7b16cbebdcd1c2dc13b03ab6fe2a0e01124fd12841dfa384bb55949c360",
        "lmfoundry.json:recipe_file":
            "74234e98afe7498fb5daf1f36ac2d78acc339464f950703b8c019892f982b90b",
        "lmfoundry.json:calibration":
            "39b25f7d4e89c6b509a7cfdb7cd3e8214c9a1d71e74e3dd95638ca71e63d0439",
    },
    "gptq-w4a16-g32": {
        "model-00001-of-00004.safetensors":
            "805cf5d8d36371e90aa991f55a9b6597a0e8ff1668a1e079ff71f8375d1a7837",
        "model-00004-of-00004.safetensors":
            "3445777c7c49c2ba6f575c7828904594b49cae1426f3a4e3bbde75b25b1f2ac8",
        "config.json":
            "b51be5a041ceac8ad421ab1986284ea508e74053b989eae59fa317a6d1ec9fca",
        "lmfoundry.json:recipe":
            "148dc97e6e4b3d3a580d72cb00cdae4ac0ad482396e01cd9fff6cec13bf45719",
        "lmfoundry.json:recipe_file":
            "74234e98afe7498fb5daf1f36ac2d78acc339464f950703b8c019892f982b90b",
        "lmfoundry.json:calibration":
            "882922390bda891ce85f2f67828c4150fe6a2bd5627ad80e4bd780ada8903295",
    },
    "recipe-yaml-gptq": {
        "model-00001-of-00004.safetensors":
            "805cf5d8d36371e90aa991f55a9b6597a0e8ff1668a1e079ff71f8375d1a7837",
        "model-00004-of-00004.safetensors":
            "3445777c7c49c2ba6f575c7828904594b49cae1426f3a4e3bbde75b25b1f2ac8",
        "config.json":
            "dcf0da355bd13c4e7e602168717ce8f51d2ed4bf8a685ce45ad0c273aa65c78e",
        "lmfoundry.json:recipe":
            "5b4d2f204c379fc594f9d6b43ff3764153a957cc341cee5fd3c4f5d1e6bcbd70",
        "lmfoundry.json:recipe_file":
            "f141a549055826ac36f818c899a60e08a9bf315c12f186865a2aede2729f8726",
        "lmfoundry.json:calibration":
            "882922390bda891ce85f2f67828c4150fe6a2bd5627ad80e4bd780ada8903295",
    },
    "rtn-w4a16-g32": {
        "model-00001-of-00004.safetensors":
            "805cf5d8d36371e90aa991f55a9b6597a0e8ff1668a1e079ff71f8375d1a7837",
        "model-00002-of-00004.safetensors":
            "d5304263905b8863bbad715d1287c61360ef5b8ee0a161a40a9f9543efa09107",
        "model-00003-of-00004.safetensors":
            "9ef239287125c493ce36f678e7791cfc3b20e51723f0cd634f11170c1d48e3fa",
        "model-00004-of-00004.safetensors":
            "3445777c7c49c2ba6f575c7828904594b49cae1426f3a4e3bbde75b25b1f2ac8",
        "config.json":
            "b51be5a041ceac8ad421ab1986284ea508e74053b989eae59fa317a6d1ec9fca",
        "lmfoundry.json:recipe":
            "dbdebf003b45a3295ed041285d6542104756f02023fca10cb1787b426776227b",
        "lmfoundry.json:recipe_file":
            "74234e98afe7498fb5daf1f36ac2d78acc339464f950703b8c019892f982b90b",
        "lmfoundry.json:calibration":
            "39b25f7d4e89c6b509a7cfdb7cd3e8214c9a1d71e74e3dd95638ca71e63d0439",
    },
    "rtn-w8a16-channel": {
        "model-00001-of-00004.safetensors":
            "805cf5d8d36371e90aa991f55a9b6597a0e8ff1668a1e079ff71f8375d1a7837",
        "model-00002-of-00004.safetensors":
            "492b14315f7cbb00b52bf62ec61a04074c33d261f5651f6a74fbb38b325a2d94",
        "model-00003-of-00004.safetensors":
            "053c27216c90f43527bc8b03142e01efd2373a099bd36242ab29c671a1e90b8b",
        "model-00004-of-00004.safetensors":
            "3445777c7c49c2ba6f575c7828904594b49cae1426f3a4e3bbde75b25b1f2ac8",
        "config.json":
            "2a4549fb18656009a69cd4177c02057fcf04a2bf7aad717355f1e8bb984a4dd2",
        "lmfoundry.json:recipe":
            "62011b1c1977fffa044470b657ea438bb630ad3ebbb81dc1ce87732a4ec2da08",
        "lmfoundry.json:recipe_file":
            "74234e98afe7498fb5daf1f36ac2d78acc339464f950703b8c019892f982b90b",
        "lmfoundry.json:calibration":
            "39b25f7d4e89c6b509a7cfdb7cd3e8214c9a1d71e74e3dd95638ca71e63d0439",
    },
    "rtn-w8a16-kv-int8": {
        "model-00001-of-00004.safetensors":
            "805cf5d8d36371e90aa991f55a9b6597a0e8ff1668a1e079ff71f8375d1a7837",
        "model-00004-of-00004.safetensors":
            "3445777c7c49c2ba6f575c7828904594b49cae1426f3a4e3bbde75b25b1f2ac8",
        "config.json":
            "e45c428c6fd98fefd9341be271f493d92ac34a659414324f4516c4a972927050",
        "lmfoundry.json:recipe":
            "0f8317fa1ab61e45e61e19e63c4c24651c102b021de007ef94abc22a65712bb7",
        "lmfoundry.json:recipe_file":
            "74234e98afe7498fb5daf1f36ac2d78acc339464f950703b8c019892f982b90b",
        "lmfoundry.json:calibration":
            "882922390bda891ce85f2f67828c4150fe6a2bd5627ad80e4bd780ada8903295",
    },
}


# The layer shards of the calibrated cases, per (CPU path, CPU model); see the module docstring.
# Each case: (the RTN case of the same weights and grid, the tensors calibration decides).
LAYER_SHARDS = ("model-00002-of-00004.safetensors", "model-00003-of-00004.safetensors")
ISA_DEPENDENT: dict[str, tuple[str, tuple[str, ...]]] = {
    "gptq-w4a16-g32": ("rtn-w4a16-g32", (".weight_packed", ".weight_scale")),
    "recipe-yaml-gptq": ("rtn-w4a16-g32", (".weight_packed",)),  # static act-order: RTN's group scales
    "rtn-w8a16-kv-int8": ("rtn-w8a16-channel", (".k_scale", ".v_scale")),
}
ZEN4 = "AuthenticAMD family 25 model 17"  # AMD EPYC (Zen 4) VMs
# path -> [(the CPU models that gave these bytes, case -> layer shard -> sha256)]
ISA_BYTES: dict[str, list[tuple[tuple[str, ...], dict[str, dict[str, str]]]]] = {
    # recorded before the refactor on the developers' AVX-512 machines, which ZEN4 reproduces
    "avx512": [
        ((ZEN4,), {
            "gptq-w4a16-g32": {
                "model-00002-of-00004.safetensors":
                    "4ef43c48c9523dadac4317b21ab015da698705629bbe0c6c33c4e0fccc4531a8",
                "model-00003-of-00004.safetensors":
                    "6681289f1ed20b732478813ed1b23748f344fc1755dfd2da2e781f5e5ddcb739",
            },
            "recipe-yaml-gptq": {
                "model-00002-of-00004.safetensors":
                    "6b12dfcedf2c6060a3cc483915a37d241c4c53b1d088dfa43763048747cfbcae",
                "model-00003-of-00004.safetensors":
                    "2990f385d87a422dd7e8224b5020e45b0bdd4a2a74286a2448f93f46aa1d9359",
            },
            "rtn-w8a16-kv-int8": {
                "model-00002-of-00004.safetensors":
                    "2fdb820dece732d098bb420b835c80c88fb7dc7f7bc8bfd4c133ea1a3b81c047",
                "model-00003-of-00004.safetensors":
                    "412012f36cacd308752c56e9260dc12710e26c19c3aea06d1ac3cad7eedeb082",
            },
        }),
    ],
    # recorded on an AVX2-only AMD EPYC VM in December (its family and model were not recorded);
    # ZEN4 gives the same bytes under LMFOUNDRY_CPU_ISA=avx2
    "avx2": [
        ((ZEN4, "AuthenticAMD, AVX2-only EPYC VM"), {
            "gptq-w4a16-g32": {
                "model-00002-of-00004.safetensors":
                    "998c1e0b6f5a0fca572bdb18088b7ad63feb7bb486f2c546da0b1d85186bca9a",
                "model-00003-of-00004.safetensors":
                    "c84a8e8e2f8c51f34fdd5a2a7663fd8d00d2f10b94dd0e006b3d632216e2b802",
            },
            "recipe-yaml-gptq": {
                "model-00002-of-00004.safetensors":
                    "f547db269ebf4cbc4ef5d6346a08f60327b67be96b195a8db97cc6db0a31dc78",
                "model-00003-of-00004.safetensors":
                    "694277e12cb17d492d1c1d3a7c93d413f88b2ab8bd6f4ef6ab986aab11e32b9b",
            },
            "rtn-w8a16-kv-int8": {
                "model-00002-of-00004.safetensors":
                    "2fdb820dece732d098bb420b835c80c88fb7dc7f7bc8bfd4c133ea1a3b81c047",
                "model-00003-of-00004.safetensors":
                    "412012f36cacd308752c56e9260dc12710e26c19c3aea06d1ac3cad7eedeb082",
            },
        }),
    ],
}

CASES = {
    "rtn-w4a16-g32": ["--method", "rtn", "--scheme", "w4a16", "--group-size", "32"],
    "rtn-w8a16-channel": ["--method", "rtn", "--scheme", "w8a16", "--per-channel"],
    "gptq-w4a16-g32": ["--method", "gptq", "--scheme", "w4a16", "--group-size", "32", "--calib", "{calib}",
                       "--num-samples", "4", "--seq-len", "32"],
    "fp8-dynamic": ["--method", "fp8", "--scheme", "fp8-dynamic"],
    "recipe-yaml-gptq": ["--recipe", "smollm2-w4a16-gptq", "--calib", "{calib}", "--num-samples", "4",
                         "--seq-len", "32", "--group-size", "32", "--option", "dampening_frac=0.02"],
    "rtn-w8a16-kv-int8": ["--method", "rtn", "--scheme", "w8a16", "--per-channel", "--kv-cache", "int8",
                          "--calib", "{calib}", "--num-samples", "4", "--seq-len", "32"],
}


class NewRecording(UserWarning):
    """A calibrated case's bytes on a CPU (path and model) without a recording of them."""


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hashes")
    return tiny_model_folder(root / "model", "llama", seed=0), write_text(root / "calib.txt")


@pytest.fixture(scope="module")
def quantized(inputs, tmp_path_factory) -> Callable[[str], Path]:
    """case -> its checkpoint, quantized once per module (the bounds compare cases)."""
    from lmfoundry.cli import main

    model, calib = inputs
    root, done = tmp_path_factory.mktemp("cases"), {}

    def get(case: str) -> Path:
        if case not in done:
            flags = [a.replace("{calib}", str(calib)) for a in CASES[case]]
            err = io.StringIO()
            with redirect_stdout(io.StringIO()), redirect_stderr(err):
                try:
                    main(["quantize", str(model), "-o", str(root / case), "--quiet", *flags])
                    code = 0
                except SystemExit as exc:
                    code = exc.code or 0
            assert code == 0, err.getvalue()
            done[case] = root / case
        return done[case]
    return get


def checkpoint_hashes(folder: Path) -> dict[str, str]:
    """sha256 of the tensor files and config.json, and of the manifest's recipe and calibration
    records as written (key order included)."""
    files = sorted(folder.glob("*.safetensors")) + [folder / "config.json"]
    hashes = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    manifest = json.loads((folder / "lmfoundry.json").read_text())
    for key in ("recipe", "recipe_file", "calibration"):
        hashes[f"lmfoundry.json:{key}"] = hashlib.sha256(json.dumps(manifest[key]).encode()).hexdigest()
    return hashes


@pytest.mark.parametrize("case", sorted(CASES))
def test_checkpoint_bytes_are_unchanged(quantized, case) -> None:
    got = checkpoint_hashes(quantized(case))
    calibrated = {f: got.pop(f) for f in LAYER_SHARDS} if case in ISA_DEPENDENT else {}
    assert got == EXPECTED[case]
    if calibrated:
        check_recorded(case, calibrated)


def check_recorded(case: str, got: dict[str, str]) -> None:
    """A calibrated case's layer shards against the recordings of this CPU path (module docstring)."""
    path, cpu = isa(), machine()
    recorded = [(cpus, cases[case]) for cpus, cases in ISA_BYTES.get(path, []) if case in cases]
    for cpus, want in recorded:
        if cpu in cpus:
            assert got == want, f"{case}: the layer shards differ from the recording of this CPU ({path}, {cpu})"
            return
    if any(want == got for _, want in recorded):
        return
    warnings.warn(NewRecording(f"{case}: no recording of its layer shards on the {path} path of {cpu}; held to "
                               f"the bounds of test_calibrated_outputs_within_bounds instead. To record them, add "
                               f"to ISA_BYTES[{path!r}]: (({cpu!r},), {json.dumps({case: got})})"), stacklevel=2)


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def calibration_windows(folder: Path, calib: Path) -> torch.Tensor:
    """The token windows the job calibrated on, rebuilt from its manifest and the calibration
    file it names (and checked by hash)."""
    from lmfoundry.calibration.data import load_calibration, token_hash
    from lmfoundry.checkpoint.tokenizer import load_tokenizer

    c = json.loads((folder / "lmfoundry.json").read_text())["calibration"]
    assert c["source"] == calib.name
    ids = load_calibration(str(calib), load_tokenizer(folder), c["num_samples"], c["seq_len"], c["seed"]).token_ids
    assert token_hash(ids) == c["token_ids_sha256"] and c["source_sha256"] == hashlib.sha256(calib.read_bytes()).hexdigest()
    return ids


def float64_model(folder: Path) -> torch.nn.Module:
    from lmfoundry.checkpoint.folder import CheckpointReader
    from lmfoundry.runtime.checkpoint_model import load_causal_lm

    return load_causal_lm(CheckpointReader(folder), torch.float64)


@pytest.mark.parametrize("case", sorted(ISA_DEPENDENT))
def test_calibrated_outputs_within_bounds(inputs, quantized, case) -> None:
    """A calibrated case held to what the math allows any CPU's rounding, recorded or not.

    Every tensor calibration does not decide (embeddings, norms, shapes, the KV case's RTN
    weights) equals the RTN case of the same weights and grid byte for byte. The calibrated ones:
    - KV scales: absmax / 127 of the K and V each layer stores, recomputed in float64 from the
      checkpoint itself (its weights, and its KV round trip in the layers before) on the same
      windows. float32 sums of n products move an element by at most about n·u relative to the
      sum of their magnitudes (u = 2^-24, n the hidden size), far below the 2^-12 allowed (plus a
      step of the scale's dtype, which rounds it up); a changed rule (another qmax, the absmax of another tensor or axis) moves a scale by a step of
      the int8 grid (1/127) or more.
    - GPTQ: each linear's output error ||(W - Q) X^T||^2 on its calibration inputs X (the
      checkpoint's own layers before it, in float64) is below RTN's on the same grid. GPTQ
      quantizes column by column and spreads each column's rounding error over the columns not yet
      quantized; the error left at column j weighs 1 / [H_F^-1]_jj <= H_jj (H_F the Hessian of
      those columns), where RTN's weighs H_jj, so in expectation over the rounding GPTQ's error is
      at most RTN's, column by column, and over the rows the sums concentrate. A GPTQ whose
      Hessian, updates, order or grid broke loses that margin."""
    partner, decided = ISA_DEPENDENT[case]
    folder = quantized(case)
    ours, rtn = tensors(folder), tensors(quantized(partner))
    calibrated = {n for n in ours if n.endswith(decided)}
    assert set(ours) - calibrated == set(rtn) - calibrated
    for name in sorted(set(rtn) - calibrated):
        assert ours[name].dtype == rtn[name].dtype and torch.equal(ours[name], rtn[name]), name
    for name in sorted(calibrated & set(rtn)):
        assert (ours[name].dtype, ours[name].shape) == (rtn[name].dtype, rtn[name].shape), name
    ids = calibration_windows(folder, inputs[1])
    model = float64_model(folder)
    if case == "rtn-w8a16-kv-int8":
        kv_scales_within_bounds(model, ours, ids)
    else:
        gptq_error_below_rtn(model, folder, quantized(partner), inputs[0], ids)


def kv_scales_within_bounds(model: torch.nn.Module, stored: dict[str, torch.Tensor], ids: torch.Tensor) -> None:
    amax: dict[int, list[float]] = {}
    for i, layer in enumerate(model.model.layers):
        def observe(k: torch.Tensor, v: torch.Tensor, i: int = i, round_trip=layer.self_attn.kv_round_trip):
            seen = amax.setdefault(i, [0.0, 0.0])
            seen[0], seen[1] = max(seen[0], float(k.abs().max())), max(seen[1], float(v.abs().max()))
            return round_trip(k, v)  # the next layers see the quantized cache, as in calibration
        layer.self_attn.kv_round_trip = observe
    with torch.no_grad():
        model(ids)
    assert sorted(amax) == list(range(len(model.model.layers)))
    for i, (k, v) in amax.items():
        for name, reference in (("k_scale", k / 127), ("v_scale", v / 127)):
            scale = stored[f"model.layers.{i}.self_attn.{name}"]
            allowed = 2**-12 + torch.finfo(scale.dtype).eps  # a coarser dtype stores it rounded up a step
            assert abs(float(scale) - reference) <= allowed * reference, (i, name, float(scale), reference)


def gptq_error_below_rtn(model: torch.nn.Module, folder: Path, rtn_folder: Path, original: Path,
                         ids: torch.Tensor) -> None:
    from lmfoundry.checkpoint.folder import CheckpointReader, decode_linear

    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("model.layers.")]
    inputs: dict[str, list[torch.Tensor]] = {}
    hooks = [model.get_submodule(n).register_forward_pre_hook(
        lambda _m, args, n=n: inputs.setdefault(n, []).append(args[0].reshape(-1, args[0].shape[-1])))
        for n in names]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()

    def dequantized(where: Path) -> dict[str, torch.Tensor]:
        reader = CheckpointReader(where)
        assert reader.plan is not None
        return {n: decode_linear(reader.prefixed(n), reader.plan.scheme_for(n)).dequantize(torch.float64)
                for n in names}

    floats = CheckpointReader(original).get([f"{n}.weight" for n in names])
    gptq, rtn = dequantized(folder), dequantized(rtn_folder)
    for n in names:
        x, w = torch.cat(inputs[n]), floats[f"{n}.weight"].double()
        err_gptq, err_rtn = (float(((w - q) @ x.T).square().sum()) for q in (gptq[n], rtn[n]))
        assert err_gptq < err_rtn, f"{n}: GPTQ's output error {err_gptq:.4g} is not below RTN's {err_rtn:.4g}"


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.heavy  # the module again per CPU path; the fast tier holds the machine's own path
@pytest.mark.parametrize("path", ["amx", "avx512", "avx2"])
def test_every_cpu_path(path: str) -> None:
    """This module's golden cases under each path the CPU has, forced (`LMFOUNDRY_CPU_ISA`): so
    an AMX CPU runs them through AMX's kernels and every CPU through AVX2's. The child's first line
    names its path; bytes it has no recording of come back as this test's warnings."""
    if path not in supported():
        pytest.skip(f"this CPU has no {path} path")
    env = {**os.environ, ENV: path, "OMP_NUM_THREADS": "1"}  # the recordings are of one thread
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not slow", str(Path(__file__))], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1800)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert any(line.startswith(f"cpu: {path}") for line in out.splitlines()[:5]), out[:2000]
    assert f"{len(CASES) + len(ISA_DEPENDENT)} passed" in out and "skipped" not in out, out[-3000:]
    for line in out.splitlines():
        if "NewRecording: " in line:
            warnings.warn(NewRecording(f"under {ENV}={path}: {line.split('NewRecording: ', 1)[1]}"), stacklevel=1)
