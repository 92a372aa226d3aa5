#!/usr/bin/env bash
# The one prepared run for a lent GPU: every GPU-only check and timing, in priority order, inside
# one command's budget, with everything it measured left under $OUT.
#
#   bash benchmarks/gpu_lease.sh wheels   # here, with pip: cp312 wheels of what the GPU image lacks -> .whl/
#   bash benchmarks/gpu_lease.sh run      # there (device tool: carry [".whl"], timeout_s 600)
#   bash benchmarks/gpu_lease.sh tiles    # there, a call of its own: the tile sweep alone (below)
#
# Steps (each under its own timeout, skipped when the budget is spent; a failure does not stop the next):
#   1. kernels      benchmarks/gpu_kernels.py --graph: tiled W4A16 on 8B/70B layers vs cuBLAS bf16,
#                   FlashDecoding vs SDPA at batch 1/16/64 x 4096, INT8/FP8 GEMM vs torch._int_mm /
#                   torch._scaled_mm at 4096^3, 8192^3 and M = 1/16/64, causal prefill vs SDPA (issue 14)
#   2. calibration  benchmarks/calibration_scale.py --devices cuda: GPTQ and RTN per-layer time and host
#                   peak on the Llama-3-8B shape (2 layers; the CPU rows are in calibration_scale_8b.md) (issue 15)
#   3. serve        benchmarks/gpu_serve.py: an engine bundle's cubins end to end, tokens vs CPU references,
#                   decode tok/s with/without CUDA graphs vs torch eager and torch.compile
# BUDGET_S (default 570) caps the whole run; the files in $OUT (7, within the tool's 8) are the record.
# `tiles` runs one step instead (its own call: $OUT would hold more than 8 files after `run`'s):
#   tiles       benchmarks/tile_sweep.py: compile/tune.py's w4a16_tiled candidates on the 8B/70B layers,
#               checked and graph-timed; the winners as $OUT/tiles.patch of kernels/tiles.py's MEASURED
#               tables (apply through a reviewed commit), every timing in $OUT/tiles.json (issue 44)
set -u -o pipefail
cd "$(dirname "$0")/.."

WHEELS=(compressed-tensors==0.20.1 loguru==0.7.3 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
        typing-inspection==0.4.5 setuptools==84.2.1)

if [ "${1:-}" = "wheels" ]; then
    # The GPU image has torch, triton, transformers, safetensors, click, tqdm, psutil, prometheus-client
    # (see the device tool's KINDS.md); `lmfoundry quantize` also imports compressed-tensors (and its
    # pydantic / loguru). Pure-Python wheels plus pydantic-core built for the image's CPython 3.12.
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${WHEELS[@]}" || exit 1
    # the calibration text quantize reads (nothing can be fetched there), under the cache folder the
    # run points LMFOUNDRY_CACHE at
    python3 -c '
import shutil
from pathlib import Path

from lmfoundry.resources import cache_dir, calibration_text

src = calibration_text("c4")
dst = Path(".whl/cache") / src.relative_to(cache_dir())
dst.parent.mkdir(parents=True, exist_ok=True)
shutil.copyfile(src, dst)
print(dst)
' || exit 1
    ls -la .whl
    exit 0
fi
if [ "${1:-}" != "run" ] && [ "${1:-}" != "tiles" ]; then
    sed -n '2,21p' "$0"
    exit 2
fi

OUT=${OUT:-/tmp/gpu-lease}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
deadline=$((SECONDS + ${BUDGET_S:-570}))

step() {  # step NAME SECONDS CMD...: run CMD under min(SECONDS, budget left), log to $OUT/NAME.log
    local name=$1 want=$2 left
    shift 2
    left=$((deadline - SECONDS))
    if [ "$left" -lt 45 ]; then
        echo "== $name skipped: ${left} s of the budget left" | tee -a "$OUT/lease.log"
        return
    fi
    [ "$want" -gt "$left" ] && want=$left
    echo "== $name (timeout ${want} s)"
    timeout "$want" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 60 "$OUT/$name.log"
    echo "== $name rc=$rc after $((SECONDS)) s" | tee -a "$OUT/lease.log"
}

if [ -d .whl ]; then
    # the missing libraries (setuptools too: the build below), then lmfoundry itself, so the
    # `python3 -m lmfoundry.cli` subprocesses import it as an installed package
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} \
        && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/lmf . \
        && export PYTHONPATH=/tmp/lmf:$PYTHONPATH LMFOUNDRY_CACHE=$PWD/.whl/cache
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import compressed_tensors; print('compressed-tensors', compressed_tensors.__version__)"; } 2>&1 \
    | tee "$OUT/lease.log"

if [ "$1" = "tiles" ]; then
    step tiles $((${BUDGET_S:-570} - 30)) python3 benchmarks/tile_sweep.py --budget-s $((${BUDGET_S:-570} - 90)) \
        --out "$OUT/tiles.patch" --json "$OUT/tiles.json"
    echo "lease done in ${SECONDS} s" | tee -a "$OUT/lease.log"
    exit 0
fi
step kernels 330 python3 benchmarks/gpu_kernels.py --graph \
    --only w4a16_llm,w4a16_tiled,paged_decode,gemm8,prefill --json "$OUT/kernels.json"
step calibration 110 python3 benchmarks/calibration_scale.py --workdir /tmp/scale8b --devices cuda \
    --methods rtn,gptq --layers 2 --out "$OUT/calibration.md"
step serve 240 python3 benchmarks/gpu_serve.py --out "$OUT/serve.md"
echo "lease done in ${SECONDS} s" | tee -a "$OUT/lease.log"
