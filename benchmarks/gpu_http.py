"""An engine bundle served through HTTP: `lmfoundry serve BUNDLE --device cuda`, then `lmfoundry
bench` against it at several concurrency levels (streamed /v1/completions, a shared prompt prefix).

    python benchmarks/gpu_http.py --bundle DIR [--device cuda] [--concurrency 1,16,64] [--out bench.json]

If DIR holds no bundle, gpu_serve.py's random W4A16 Llama (`--preset`) is written and compiled
there first; `serve` needs a tokenizer, so `--tokenizer DIR` names one (the checkpoint's vocabulary
grows to cover it). Both processes are started as a user starts them, from the current directory.
`--out` gets `lmfoundry bench`'s JSON plus how the server was run. The GPU lease's HTTP step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import wait_for_url  # noqa: E402  (the tests' reader of `serve`'s URL line)

from lmfoundry.child_python import python_command  # noqa: E402
from lmfoundry.engine_bundle.engine_manifest import is_engine_bundle  # noqa: E402


def serve_and_bench(bundle: Path, device: str, levels: list[int], out: Path, max_tokens: int = 64,
                    requests: int | None = None, start_timeout: float = 300) -> dict[str, Any]:
    """Serve `bundle` on `device`, bench it, stop it; `lmfoundry bench`'s result with the server's
    start-up seconds and command lines added (also written to `out`)."""
    serve = python_command("lmfoundry.cli", "serve", str(bundle), "--device", device, "--port", "0")
    t0 = time.perf_counter()
    proc = subprocess.Popen(serve, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        url = wait_for_url(proc, start_timeout).removesuffix("/v1")  # kills `serve` when it prints none
        started = time.perf_counter() - t0
        tail: deque[str] = deque(maxlen=200)  # keep reading `serve`'s log, so a full pipe never blocks it
        threading.Thread(target=tail.extend, args=(proc.stdout,), daemon=True).start()
        with tempfile.TemporaryDirectory() as tmp:  # the plot bench writes beside its JSON stays here
            raw = Path(tmp) / "bench.json"
            bench = python_command("lmfoundry.cli", "bench", url, "--concurrency", ",".join(map(str, levels)),
                                   "--max-tokens", str(max_tokens), "-o", str(raw),
                                   *(["--requests", str(requests)] if requests else []))
            done = subprocess.run(bench, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"lmfoundry bench failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
            result = json.loads(raw.read_text())
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    result.update(device=device, bundle=str(bundle), serve_start_s=started, serve_log="".join(tail)[-4000:],
                  commands={"serve": serve, "bench": bench})
    out.write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True, help="the bundle (built here when absent)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=None, help="requests per level (bench's default otherwise)")
    ap.add_argument("--preset", default="1b", help="gpu_serve.py's preset, for a bundle built here")
    ap.add_argument("--tokenizer", type=Path, default=None, help="tokenizer folder, for a bundle built here")
    ap.add_argument("--out", type=Path, default=Path("bench.json"))
    args = ap.parse_args()
    if not is_engine_bundle(args.bundle):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from gpu_serve import build_bundle

        arch = "hopper"
        if args.device.startswith("cuda"):
            import torch

            arch = {(8, 0): "ampere", (8, 9): "ada"}.get(torch.cuda.get_device_capability(), "hopper")
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            build_bundle(args.preset, Path(tmp), arch, args.tokenizer, args.bundle)
            print(f"bundle built in {time.perf_counter() - t0:.0f} s: {args.bundle}", flush=True)
    result = serve_and_bench(args.bundle, args.device, [int(x) for x in args.concurrency.split(",")], args.out,
                             args.max_tokens, args.requests)
    for lv in result["levels"]:
        print(f"c={lv['concurrency']:<3} {lv['output_tokens_per_s']:8.1f} tok/s  TTFT p50 "
              f"{(lv['ttft_s']['p50'] or 0) * 1e3:7.1f} ms  ITL p50 {(lv['itl_s']['p50'] or 0) * 1e3:6.1f} ms  "
              f"requests {lv['requests']} errors {lv['errors']}", flush=True)


if __name__ == "__main__":
    main()
