#!/usr/bin/env bash
# The one prepared run for a lent GPU: every GPU-only check and timing, in priority order, inside
# one command's budget, from a plain copy of the checkout on a machine with no network.
#
#   bash benchmarks/gpu_lease.sh wheels   # here, with pip: what the GPU image lacks (cp312 wheels), and the
#                                         # calibration text and tokenizer the run reads -> .whl/
#   bash benchmarks/gpu_lease.sh run      # there (device tool: carry [".whl"], timeout_s 600)
#
# `run` first installs the carried wheels and lmfoundry itself under $WORK (no index, no download;
# HF_HUB_OFFLINE, PIP_NO_INDEX), then runs STEPS (default all four, in this order), each under its
# own timeout, skipped when the budget is spent; a failure does not stop the next:
#   kernels      benchmarks/gpu_kernels.py --graph: tiled W4A16 on 8B/70B layers vs cuBLAS bf16, FlashDecoding
#                vs SDPA at batch 1/16/64 x 4096, INT8/FP8 GEMM vs torch._int_mm / torch._scaled_mm at 4096^3,
#                8192^3 and M = 1/16/64 (K up to 28672), causal prefill vs SDPA (issue 14)
#   calibration  benchmarks/calibration_scale.py --devices cuda: GPTQ and RTN seconds per layer and host peak
#                on the Llama-3-8B shape (2 layers; the CPU rows are in calibration_scale_8b.md) (issue 15)
#   serve        benchmarks/gpu_serve.py: a W4A16 bundle's cubins end to end, zero JIT calls, tokens vs the CPU
#                references, decode tok/s with/without CUDA graphs vs torch eager and torch.compile
#   http         benchmarks/gpu_http.py: `lmfoundry serve BUNDLE --device cuda` (the serve step's bundle) and
#                `lmfoundry bench` through HTTP at concurrency 1/16/64
# then benchmarks/gpu_lease_report.py writes $OUT/gpu_lease_h200.md (on an H200): the record's table
# (JIT calls, calibration s/layer on the GPU, the HTTP bench); copy it to benchmarks/results/.
# $OUT (default /tmp/gpu-lease) keeps 6 files, within the device tool's 8: lease.log (every step's
# log), kernels.json, calibration.json, serve.json, bench.json and the report. BUDGET_S (default 570)
# caps the run: kernels alone may take most of it, so a 15-minute lease that wants the record runs
# `STEPS=calibration,serve,http` first. LEASE_DEVICE=cpu runs the same path on CPU at toy sizes, the
# GPU-only scripts reduced to their imports (tests/benchmarks/test_gpu_lease.py, network blocked).
# `tiles` (= STEPS=tiles, a call of its own: not in the default STEPS) runs benchmarks/tile_sweep.py:
# compile/tune.py's w4a16_tiled candidates on the 8B/70B layers, checked and graph-timed; the winners
# as $OUT/tiles.patch of kernels/tiles.py's MEASURED tables (apply through a reviewed commit), every
# timing in $OUT/tiles.json (issue 44).
set -u -o pipefail
cd "$(dirname "$0")/.."

# Distributions lmfoundry imports on the lease's path that the GPU image (device tool, KINDS.md) lacks:
# quantize reads compressed-tensors (+ pydantic, loguru); serve runs fastapi (+ starlette,
# opentelemetry-api) on uvicorn, the engine process talks over pyzmq, structured output compiles with
# llguidance; setuptools >= 77 builds lmfoundry there. They are the lines of constraints.txt marked
# "lease", so the tests' venv has the versions carried here; tests/benchmarks/test_gpu_lease.py
# checks this list against what that path imports.
mapfile -t WHEELS < <(sed -n 's/^\([A-Za-z0-9_.-]*==[^ #]*\).*#[[:space:]]*lease[[:space:]]*$/\1/p' constraints.txt)
[ "${#WHEELS[@]}" -gt 0 ] || { echo "no lines marked '# lease' in constraints.txt" >&2; exit 2; }
WHEELHOUSE=${WHEELHOUSE:-$PWD/.whl}

if [ "${1:-}" = "wheels" ]; then
    # pure-Python wheels plus the binary ones (pydantic-core, pyzmq, llguidance) built for the image's CPython 3.12
    # (Ubuntu 24.04's glibc takes manylinux up to 2_39)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEELHOUSE" "${WHEELS[@]}" || exit 1
    python3 benchmarks/gpu_lease_stage.py "$WHEELHOUSE" || exit 1
    ls -la "$WHEELHOUSE"
    exit 0
fi
if [ "${1:-}" != "run" ] && [ "${1:-}" != "tiles" ]; then
    sed -n '2,31p' "$0"
    exit 2
fi

OUT=${OUT:-/tmp/gpu-lease}
WORK=${WORK:-/tmp/gpu-lease-work}
DEVICE=${LEASE_DEVICE:-cuda}
STEPS=${STEPS:-kernels,calibration,serve,http}
[ "${1:-}" = "tiles" ] && STEPS=tiles
mkdir -p "$OUT" "$WORK"
# nothing is fetched there: a step that tries says so instead of hanging on a dead network
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PIP_NO_INDEX=1
deadline=$((SECONDS + ${BUDGET_S:-570} - 15))  # the last 15 s: the report

step() {  # step NAME SECONDS CMD...: run CMD under min(SECONDS, budget left); its log goes to lease.log
    local name=$1 want=$2 left
    shift 2
    left=$((deadline - SECONDS))
    if [ "$left" -lt 45 ]; then
        echo "== $name skipped: ${left} s of the budget left" | tee -a "$OUT/lease.log"
        return
    fi
    [ "$want" -gt "$left" ] && want=$left
    echo "== $name (timeout ${want} s)"
    timeout "$want" "$@" > "$WORK/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$WORK/$name.log"
    { echo "---- $name: $*"; cat "$WORK/$name.log"; } >> "$OUT/lease.log"
    echo "== $name rc=$rc after $((SECONDS)) s" | tee -a "$OUT/lease.log"
}
want() { [[ ",$STEPS," == *",$1,"* ]]; }

{ if [ "$DEVICE" = cuda ]; then nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  else echo "$DEVICE, no GPU (LEASE_DEVICE=$DEVICE)"; fi
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "STEPS=$STEPS BUDGET_S=${BUDGET_S:-570} LEASE_DEVICE=$DEVICE"; } 2>&1 | tee "$OUT/lease.log"
# The carried wheels first, then lmfoundry itself (its build backend is among them), so that every
# `python -m lmfoundry...` the steps start imports the installed package.
if compgen -G "$WHEELHOUSE/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
        "$WHEELHOUSE"/*.whl && export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$WORK/lmf" . \
    && export PYTHONPATH=$WORK/lmf${PYTHONPATH:+:$PYTHONPATH}
export LMFOUNDRY_CACHE=$WHEELHOUSE/cache
python3 - "${WHEELS[@]}" <<'EOF' 2>&1 | tee -a "$OUT/lease.log"
# every carried distribution importable at its pinned version, and lmfoundry's entry points of the steps
import importlib, importlib.metadata as md, sys
bad = []
for w in sys.argv[1:]:
    name, version = w.split("==")
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if have != version:
        bad.append(f"{name} {have or 'missing'} (want {version})")
for mod in ("lmfoundry.cli", "lmfoundry.calibration.job", "lmfoundry.compile.bundle", "lmfoundry.runtime.server.app",
            "lmfoundry.runtime.engine.core_client", "lmfoundry.kernels.harness", "zmq", "llguidance", "uvicorn"):
    try:
        importlib.import_module(mod)
    except Exception as exc:  # noqa: BLE001 - report every missing piece at once
        bad.append(f"{mod}: {type(exc).__name__}: {exc}")
import lmfoundry
print("lmfoundry from", lmfoundry.__file__, "| transformers", md.version("transformers"))
print("prepare:", "ok" if not bad else "MISSING " + "; ".join(bad))
EOF

if [ "$DEVICE" = cuda ]; then CAL_PRESET=llama3-8b SERVE_PRESET=1b; else CAL_PRESET=tiny SERVE_PRESET=tiny; fi
if want kernels; then
    if [ "$DEVICE" = cuda ]; then
        step kernels 240 python3 benchmarks/gpu_kernels.py --graph \
            --only w4a16_llm,w4a16_tiled,paged_decode,gemm8,prefill --json "$OUT/kernels.json"
    else  # no GPU: the script's imports only
        step kernels 60 python3 benchmarks/gpu_kernels.py --help
    fi
fi
if want calibration; then
    step calibration 120 python3 benchmarks/calibration_scale.py --workdir "$WORK/scale" --devices "$DEVICE" \
        --methods rtn,gptq --layers 2 --preset "$CAL_PRESET" --tokenizer "$WHEELHOUSE/tokenizer" \
        --out "$WORK/calibration.md"
    [ -f "$WORK/calibration.json" ] && cp "$WORK/calibration.json" "$OUT/calibration.json"
fi
if want serve; then
    if [ "$DEVICE" = cuda ]; then
        step serve 150 python3 benchmarks/gpu_serve.py --tokenizer "$WHEELHOUSE/tokenizer" --keep "$WORK/bundle" \
            --json "$OUT/serve.json" --out "$WORK/serve.md"
    else
        step serve 60 python3 benchmarks/gpu_serve.py --help
    fi
fi
if want http; then
    step http 120 python3 benchmarks/gpu_http.py --bundle "$WORK/bundle" --device "$DEVICE" --preset "$SERVE_PRESET" \
        --tokenizer "$WHEELHOUSE/tokenizer" --concurrency "${LEASE_CONCURRENCY:-1,16,64}" \
        --max-tokens "${LEASE_MAX_TOKENS:-64}" --out "$OUT/bench.json"
fi
if want tiles; then
    if [ "$DEVICE" = cuda ]; then
        step tiles $((${BUDGET_S:-570} - 45)) python3 benchmarks/tile_sweep.py --budget-s $((${BUDGET_S:-570} - 90)) \
            --out "$OUT/tiles.patch" --json "$OUT/tiles.json"
    else
        step tiles 60 python3 benchmarks/tile_sweep.py --help
    fi
fi
python3 benchmarks/gpu_lease_report.py "$OUT" | tail -n 40
echo "lease done in ${SECONDS} s" | tee -a "$OUT/lease.log"
