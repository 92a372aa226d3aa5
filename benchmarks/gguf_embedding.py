"""GGUF export, the token embedding's storage type: file size and llama.cpp's perplexity of the
export with its embedding in F32 (the checkpoint's float32, `--embedding-type auto`), F16 and
Q8_0, beside our runtime's perplexity of the checkpoint itself, measured in the same run.

llama.cpp's perplexity is llama-perplexity's measure (chunks of --ctx tokens, a BOS first only
when the GGUF's `tokenizer.ggml.add_bos_token` says so, the predictions of the second half of each
chunk counted), computed by llama.cpp itself through the xllamacpp wheel (the side venv of
benchmarks/peers/venvs.py). That wheel exposes llama.cpp's server, not the llama-perplexity tool,
and its server returns no prompt logprobs (`echo` is ignored); so each counted position is one
completion request whose prompt is the chunk up to that token (the cached prefix is reused, one
new token is evaluated) and whose single generated token is forced to the text's next token by a
logit bias: llama.cpp reports that token's log-probability from the raw logits, before any bias
(`n_probs`), which is what llama-perplexity sums. The worker checks that the forced token came
back and that no BOS was added to the prompt.

    python benchmarks/gguf_embedding.py CHECKPOINT [--xllamacpp-python PY] [--ctx 512] [--chunks 6]
        [--threads 2] [--out benchmarks/results/gguf_embedding_smollm2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_export import ppl_like_llama_cpp  # noqa: E402
from peers.venvs import ensure  # noqa: E402

KINDS = ("auto", "f16", "q8_0")  # auto: the checkpoint's float32 embedding

WORKER = r"""
import json, sys
import xllamacpp as x
gguf_path, ids_file, ctx, chunks, threads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
ids = json.load(open(ids_file))
p = x.CommonParams()
p.model.path, p.n_ctx, p.n_parallel, p.port = gguf_path, ctx, 1, 0
p.cpuparams.n_threads = p.cpuparams_batch.n_threads = threads
server = x.Server(p)
nll, count = 0.0, 0
for c in range(min(chunks, len(ids) // ctx)):
    chunk = ids[c * ctx:(c + 1) * ctx]
    for pos in range(ctx // 2, ctx - 1):
        target = chunk[pos + 1]
        r = server.handle_completions({"prompt": chunk[:pos + 1], "n_predict": 1, "n_probs": 1, "temperature": 0,
                                       "logit_bias": [[target, 100.0]], "cache_prompt": True})
        got = r["choices"][0]["logprobs"]["content"][0]
        assert got["id"] == target, (got, target)
        assert r["usage"]["prompt_tokens"] == pos + 1, r["usage"]  # no BOS added in front
        nll -= got["logprob"]
        count += 1
print(json.dumps({"nll": nll, "count": count}))
"""


def llama_cpp_ppl(python: Path, gguf_file: Path, ids: list[int], ctx: int, chunks: int, threads: int,
                  work: Path) -> tuple[float, float]:
    """(llama.cpp's perplexity of `gguf_file` on `ids`, seconds) through the xllamacpp worker."""
    ids_file = work / "ids.json"
    ids_file.write_text(json.dumps(ids))
    start = time.perf_counter()
    proc = subprocess.run([str(python), "-c", WORKER, str(gguf_file), str(ids_file), str(ctx), str(chunks),
                           str(threads)], capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    if proc.returncode != 0:
        raise RuntimeError(f"xllamacpp worker failed:\n{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    return math.exp(res["nll"] / res["count"]), time.perf_counter() - start


def add_bos(gguf_file: Path) -> bool:
    import gguf

    field = gguf.GGUFReader(gguf_file).fields.get("tokenizer.ggml.add_bos_token")
    return bool(field.parts[field.data[0]][0]) if field is not None else True  # llama.cpp's BPE default


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="a quantized checkpoint GGUF export takes (e.g. RTN W4A16 g64)")
    ap.add_argument("--xllamacpp-python", default=None, help="python of the xllamacpp venv (default: installed "
                                                             "by benchmarks/peers/venvs.py)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokenizer-pre", default="smollm")
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from lmfoundry.calibration.data import eval_token_stream
    from lmfoundry.export.gguf import export_gguf
    from lmfoundry.runtime.loader import load_model

    python = Path(args.xllamacpp_python) if args.xllamacpp_python else ensure("xllamacpp")
    model, tok = load_model(args.checkpoint, dtype=torch.float32)
    stream, source, _ = eval_token_stream(None, tok)
    ids = stream[: args.ctx * args.chunks].tolist()
    rows = []
    with tempfile.TemporaryDirectory(prefix="gguf-emb-") as tmp:
        work = Path(tmp)
        ours = None
        for kind in KINDS:
            out = work / f"{kind}.gguf"
            report = export_gguf(args.checkpoint, out, tokenizer_pre=args.tokenizer_pre, progress=False,
                                 embedding_type=kind)
            bos = add_bos(out)
            if ours is None:  # our runtime on the checkpoint, llama-perplexity's way, the same BOS rule
                ours = ppl_like_llama_cpp(model, ids, tok.bos_token_id if bos else None, args.ctx, args.chunks)
            ppl, seconds = llama_cpp_ppl(python, out, ids, args.ctx, args.chunks, args.threads, work)
            emb = next(k for k in report.types if k not in ("Q4_0", "Q4_1", "F32")) if kind != "auto" else "F32"
            rows.append({"embedding": emb, "option": kind, "mib": report.bytes / 2**20, "llama_cpp_ppl": ppl,
                         "seconds": seconds, "add_bos_token": bos})
            print(f"{emb}: {report.bytes / 2**20:.1f} MiB, llama.cpp ppl {ppl:.4f} ({seconds:.0f} s)", file=sys.stderr)
    result = {"checkpoint": str(args.checkpoint), "text": source, "ctx": args.ctx, "chunks": args.chunks,
              "scored_tokens": args.chunks * (args.ctx // 2 - 1), "ours_ppl": ours, "rows": rows,
              "threads": args.threads, "load": os.getloadavg(), "command": "python " + " ".join(sys.argv)}
    lines = [f"# GGUF token embedding: F32 vs F16 vs Q8_0 ({Path(args.checkpoint).name})", "",
             f"Command: `{result['command']}`", "",
             f"Text: {source}, {args.chunks} chunks of {args.ctx} tokens, the second half of each scored "
             f"({result['scored_tokens']} tokens). Our runtime on the checkpoint (float32, llama-perplexity's "
             f"way): **{ours:.4f}**.", "",
             "| embedding | file MiB | llama.cpp perplexity | vs F32 | vs ours on the checkpoint | add_bos_token |",
             "|---|---|---|---|---|---|"]
    base = rows[0]["llama_cpp_ppl"]
    for r in rows:
        lines.append(f"| {r['embedding']} | {r['mib']:.1f} | {r['llama_cpp_ppl']:.4f} | "
                     f"{r['llama_cpp_ppl'] / base:.4f} | {r['llama_cpp_ppl'] / ours:.4f} | {r['add_bos_token']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        Path(args.out).with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
