"""Bit-identical bundles across restructuring (issue #26): the same checkpoint compiles to the same
bytes in every weights file and every kernel file (cubin, PTX, launch metadata).

The digests below were recorded after the structure moves of December (checkpoint I/O package,
bundle loader into the runtime, the layout below both, the renames). Against the code before
those moves (6cf2521) the same builds gave the same tensors in the same order and byte-identical
cubins; two things differed, each for a reason of its own: the PTX of `paged_decode_split` (the
split and unsplit decode kernels became one body, 9ac0d6d; its cubins did not change), and the
header of the repacked weights, whose safetensors metadata came out in a per-process hash order
(now one key: `test_build.py::test_bundles_are_byte_reproducible_across_processes`). A deliberate
change of the bundle format or of a kernel updates this table and says so in its commit: each
kernel's launch metadata (.json) now records the divisibility it assumed of every parameter
(`divisibility`, issue #43; its cubins and PTX did not change), and Hopper's W4A16 decode buckets
take 64-column tiles split over at least two programs per SM (issue #44).

The bytes are the same on every CPU (issue #50), so the table holds for every CPU path: the kernels
are Triton and ptxas output for GPU architectures, and the weights are copied and repacked with
integer operations and elementwise conversions (correctly rounded on every CPU); no sum over
data is rounded on the CPU.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from checkpoints import write_checkpoint

from lmfoundry.compile.bundle import build_engine

CASES = {
    "w4a16-g32-asym-actorder": dict(scheme="w4a16", group=32, symmetric=False, actorder=True),
    "w8a8-static-kv-int8": dict(scheme="w8a8", static_input=True, kv_cache="int8"),
}
# sha256 of the sorted {path: sha256} of each part of the bundle
EXPECTED = {
    "w4a16-g32-asym-actorder": {
        "weights": "9ad83e1c6ad6b01ca3e62bdfde1c36db689b81afa7188bda8109288c3184fe67",
        "kernels": "d443bff4c99d7d99a5506b579c9a25a055874eceb73346c62e2b2ed97d3e9db0",
    },
    "w8a8-static-kv-int8": {
        "weights": "e034fbafdf79f9b2c4d48b899ba271dde7f05ff772444fd631d80af7b1080036",
        "kernels": "e07dac968ca35944d43a07eec7462627808dd12c939952e606bbbf36a13620fc",
    },
}


def _digests(engine: Path) -> dict[str, str]:
    files = {p.relative_to(engine).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(engine.rglob("*")) if p.is_file() and p.name != "engine.json"}
    out = {}
    for part in ("weights", "kernels"):
        chosen = {k: v for k, v in files.items() if k.startswith(part + "/")}
        out[part] = hashlib.sha256(json.dumps(chosen, sort_keys=True).encode()).hexdigest()
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_bundle_bytes_are_unchanged(case: str, tmp_path) -> None:
    checkpoint = write_checkpoint(tmp_path / "ck", **CASES[case])
    engine = build_engine(checkpoint, ["hopper", "ampere"], tmp_path / "engine", progress=False).output
    assert _digests(engine) == EXPECTED[case]
    # engine.json names its source by content, not by where it lay (#57): no path of this machine
    text = (engine / "engine.json").read_text()
    assert str(tmp_path) not in text and '"/' not in text
    assert json.loads(text)["source"]["name"] == "ck"
