"""The files the GPU lease reads besides code, staged in one folder for a machine with no network
(`bash benchmarks/gpu_lease.sh wheels` runs this after downloading the wheels):

    python benchmarks/gpu_lease_stage.py .whl

- DIR/cache/...: `quantize`'s default calibration text, at its place in lmfoundry's cache (the run
  points LMFOUNDRY_CACHE at DIR/cache, so nothing is fetched there);
- DIR/tokenizer/: the default model's tokenizer files, which the random checkpoints of the
  calibration and serving steps take (`serve` needs a tokenizer; calibration tokenizes its text).
Both come from this machine's lmfoundry cache, fetched into it first if missing.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def stage(dest: Path) -> list[Path]:
    from lmfoundry.checkpoint.sources import resolve_model
    from lmfoundry.resources import cache_dir, calibration_text

    written = []
    text = calibration_text("c4")
    target = dest / "cache" / text.relative_to(cache_dir())
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(text, target)
    written.append(target)
    model = resolve_model("smollm2-135m")
    (dest / "tokenizer").mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (model / name).is_file():
            shutil.copyfile(model / name, dest / "tokenizer" / name)
            written.append(dest / "tokenizer" / name)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    for path in stage(Path(sys.argv[1])):
        print(path)
