"""Bit-identical checkpoints across the quantize-job refactor (issue #26): the recipe became typed
dataclasses and the run moved from `lmfoundry/commands/quantize.py` into `calibration/job.py`.

The hashes below were recorded from the code *before* that refactor, by running these same
command lines; the test guards that the checkpoint bytes (every *.safetensors file and
config.json) stay identical. lmfoundry.json is not hashed: it records times and RSS. The tiny
model and the calibration text are seeded, so the bytes are stable run to run. A deliberate
change of the output format updates the table (and says so in the commit).

GPTQ's bytes also depend on the CPU: its Hessian products and Cholesky factor go through BLAS
kernels chosen per instruction set, whose float32 sums round in another order, and a code at a
rounding boundary flips. So its tensor files are recorded per ISA (`lmfoundry.runtime.cpu_isa`,
one thread as `make test` runs): EXPECTED holds the AVX-512 recording, ISA_TENSORS the others.
On a CPU of an ISA without a recording those cases are skipped, saying so."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from helpers import run_cli, tiny_model_folder, write_text

from lmfoundry.runtime.cpu_isa import isa

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
            "914b3a3b5f90c295c7e29fdc3ef372038507b726ef7ddb2ff38548ff212a771f",
    },
    "gptq-w4a16-g32": {
        "model-00001-of-00004.safetensors":
            "805cf5d8d36371e90aa991f55a9b6597a0e8ff1668a1e079ff71f8375d1a7837",
        "model-00002-of-00004.safetensors":
            "4ef43c48c9523dadac4317b21ab015da698705629bbe0c6c33c4e0fccc4531a8",
        "model-00003-of-00004.safetensors":
            "6681289f1ed20b732478813ed1b23748f344fc1755dfd2da2e781f5e5ddcb739",
        "model-00004-of-00004.safetensors":
            "3445777c7c49c2ba6f575c7828904594b49cae1426f3a4e3bbde75b25b1f2ac8",
        "config.json":
            "b51be5a041ceac8ad421ab1986284ea508e74053b989eae59fa317a6d1ec9fca",
        "lmfoundry.json:recipe":
            "83245ad3ce957bd451101860116b55db843f48bafd705fc3b18cb34a388f65d0",
        "lmfoundry.json:recipe_file":
            "74234e98afe7498fb5daf1f36ac2d78acc339464f950703b8c019892f982b90b",
        "lmfoundry.json:calibration":
            "17c3d1357e91e26ca529634400adbbdd517c7ccdbc919d626a60ec87daeda966",
    },
    "recipe-yaml-gptq": {
        "model-00001-of-00004.safetensors":
            "805cf5d8d36371e90aa991f55a9b6597a0e8ff1668a1e079ff71f8375d1a7837",
        "model-00002-of-00004.safetensors":
            "6b12dfcedf2c6060a3cc483915a37d241c4c53b1d088dfa43763048747cfbcae",
        "model-00003-of-00004.safetensors":
            "2990f385d87a422dd7e8224b5020e45b0bdd4a2a74286a2448f93f46aa1d9359",
        "model-00004-of-00004.safetensors":
            "3445777c7c49c2ba6f575c7828904594b49cae1426f3a4e3bbde75b25b1f2ac8",
        "config.json":
            "dcf0da355bd13c4e7e602168717ce8f51d2ed4bf8a685ce45ad0c273aa65c78e",
        "lmfoundry.json:recipe":
            "e9b11f20dc5864fd45a4abbed14de727278a70c479fc4bec2a53b847567fbf85",
        "lmfoundry.json:recipe_file":
            "9acde0c08ae61df3282fb060c9f8a8c4af4eee7573430882544988909a0e6ec6",
        "lmfoundry.json:calibration":
            "17c3d1357e91e26ca529634400adbbdd517c7ccdbc919d626a60ec87daeda966",
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
            "914b3a3b5f90c295c7e29fdc3ef372038507b726ef7ddb2ff38548ff212a771f",
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
            "914b3a3b5f90c295c7e29fdc3ef372038507b726ef7ddb2ff38548ff212a771f",
    },
    "rtn-w8a16-kv-int8": {
        "model-00001-of-00004.safetensors":
            "805cf5d8d36371e90aa991f55a9b6597a0e8ff1668a1e079ff71f8375d1a7837",
        "model-00002-of-00004.safetensors":
            "2fdb820dece732d098bb420b835c80c88fb7dc7f7bc8bfd4c133ea1a3b81c047",
        "model-00003-of-00004.safetensors":
            "412012f36cacd308752c56e9260dc12710e26c19c3aea06d1ac3cad7eedeb082",
        "model-00004-of-00004.safetensors":
            "3445777c7c49c2ba6f575c7828904594b49cae1426f3a4e3bbde75b25b1f2ac8",
        "config.json":
            "e45c428c6fd98fefd9341be271f493d92ac34a659414324f4516c4a972927050",
        "lmfoundry.json:recipe":
            "45e6e92ddf6e832410a2ef3553473d5539318d2a8b8c177fcf2b8dd029b26ecb",
        "lmfoundry.json:recipe_file":
            "74234e98afe7498fb5daf1f36ac2d78acc339464f950703b8c019892f982b90b",
        "lmfoundry.json:calibration":
            "17c3d1357e91e26ca529634400adbbdd517c7ccdbc919d626a60ec87daeda966",
    },
}

# GPTQ's tensor files on other instruction sets (see the module docstring), recorded with the code
# that reproduces EXPECTED on an AVX-512 machine.
ISA_DEPENDENT = ("gptq-w4a16-g32", "recipe-yaml-gptq")
ISA_TENSORS: dict[str, dict[str, dict[str, str]]] = {
    "avx512": {},
    "avx2": {
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
    },
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


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hashes")
    return tiny_model_folder(root / "model", "llama", seed=0), write_text(root / "calib.txt")


def checkpoint_hashes(folder: Path, calib: Path) -> dict[str, str]:
    """sha256 of the tensor files and config.json, and of the manifest's recipe and calibration
    records (key order included; the calibration file's temporary path and the recipe file's folder
    left out)."""
    files = sorted(folder.glob("*.safetensors")) + [folder / "config.json"]
    hashes = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    manifest = json.loads((folder / "lmfoundry.json").read_text())
    manifest["recipe_file"] = manifest["recipe_file"] and Path(manifest["recipe_file"]).name
    for key in ("recipe", "recipe_file", "calibration"):
        text = json.dumps(manifest[key]).replace(json.dumps(str(calib))[1:-1], "{calib}")
        hashes[f"lmfoundry.json:{key}"] = hashlib.sha256(text.encode()).hexdigest()
    return hashes


@pytest.mark.parametrize("case", sorted(CASES))
def test_checkpoint_bytes_are_unchanged(inputs, tmp_path, capsys, case) -> None:
    expected = EXPECTED[case]
    if case in ISA_DEPENDENT:
        here = isa()
        if here not in ISA_TENSORS:
            pytest.skip(f"GPTQ's bytes depend on the CPU's BLAS kernels; none recorded for {here}")
        expected = {**expected, **ISA_TENSORS[here].get(case, {})}
    model, calib = inputs
    out = tmp_path / case
    flags = [a.replace("{calib}", str(calib)) for a in CASES[case]]
    code, _, err = run_cli(["quantize", str(model), "-o", str(out), "--quiet", *flags], capsys)
    assert code == 0, err
    assert checkpoint_hashes(out, calib) == expected
