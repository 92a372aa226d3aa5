"""GGUF export quality: our calibrated int4 checkpoints exported to Q4_0 beside ggml's own Q4_0.

On SmolLM2-135M, every row is a perplexity on the same held-out windows (wiki, never used for
calibration), measured in this run:
- float: the source model (our reference forward);
- `ggml Q4_0`: what `llama-quantize ... Q4_0` produces for the decoder linears — the float weights
  quantized by the `gguf` package's implementation of ggml's reference Q4_0 quantizer, dequantized
  into the same reference model (embeddings stay float, as in our exports);
- ours (RTN / GPTQ / AWQ, int4 symmetric group 32, fp16 scales) exported with `lmfoundry export
  --format gguf`, the .gguf read back by transformers' GGUF loader (not our code), and beside it
  our runtime on the checkpoint itself: the two must agree (the export is exact).
Caveat from shared/RESOURCES.md: SmolLM2's "float" weights came from a Q4_1 (asymmetric g32)
grid, so asymmetric g32 would reproduce them exactly; symmetric Q4_0 is a different grid for
every row here, which keeps the comparison fair.

With `--llama-cpp DIR` (a llama.cpp source tree whose `build/bin` holds `llama-perplexity` and
`llama-quantize`), each exported .gguf is also scored by llama.cpp itself on the same text, beside
our runtime on the checkpoint scored the way llama-perplexity scores (its own tokenization of the
text, chunks of --ctx tokens, BOS first when the vocabulary asks for it, the second half of each
chunk counted); and llama.cpp's own Q4_0 of the model (`convert_hf_to_gguf.py --outtype f32`, then
`llama-quantize ... Q4_0` with the token embedding kept f16, as in our exports) is scored by it too
(the converter imports `sentencepiece`: `pip install sentencepiece` beside the project's packages).

    python benchmarks/gguf_export.py [--num-samples 32] [--seq-len 512] [--windows 40]
        [--llama-cpp path/to/llama.cpp] [--out benchmarks/results/gguf_export_smollm2.md]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def ppl_of(model, stream: torch.Tensor, ctx: int, windows: int) -> float:
    from lmfoundry.evals.perplexity import perplexity

    return perplexity(model, stream, ctx=ctx, max_windows=windows, progress=False).ppl


class HFLogits(torch.nn.Module):
    """A transformers model as the `ids -> logits` callable our perplexity takes."""

    def __init__(self, hf) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.hf(ids).logits.float()


def llama_cpp_ppl(binary: str, gguf_file: Path, text_file: Path, ctx: int, chunks: int) -> float:
    """llama.cpp's own perplexity of `gguf_file` on the text (its "Final estimate")."""
    import re
    import subprocess

    proc = subprocess.run([binary, "-m", str(gguf_file), "-f", str(text_file), "-c", str(ctx), "--chunks", str(chunks),
                           "-t", str(torch.get_num_threads()), "-b", str(ctx)], capture_output=True, text=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", proc.stdout + proc.stderr)
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"llama-perplexity failed:\n{(proc.stdout + proc.stderr)[-2000:]}")
    return float(found.group(1))


def llama_cpp_q4_0(llama_cpp: Path, source: Path, work: Path) -> Path:
    """llama.cpp's own Q4_0 of the float model: converted to an f32 .gguf by its script, then
    quantized by llama-quantize (token embedding kept f16)."""
    import subprocess
    import sys

    f32 = work / "llama-cpp-f32.gguf"
    q4 = work / "llama-cpp-q4_0.gguf"
    for cmd in ([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(source), "--outtype", "f32",
                 "--outfile", str(f32)],
                [str(llama_cpp / "build/bin/llama-quantize"), "--token-embedding-type", "f16", str(f32), str(q4),
                 "Q4_0"]):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cmd[1] if cmd[0] == sys.executable else cmd[0]} failed:\n"
                               f"{(proc.stdout + proc.stderr)[-2000:]}")
    return q4


def ppl_like_llama_cpp(model, ids: list[int], bos: int | None, ctx: int, chunks: int) -> float:
    """llama-perplexity's measure on our runtime: chunks of `ctx` tokens (the first replaced by
    BOS when the vocabulary adds one), only the predictions of the second half of each chunk
    counted (every one of them sees at least ctx/2 tokens of context)."""
    nll, count = 0.0, 0
    first = ctx // 2
    for c in range(min(chunks, len(ids) // ctx)):
        chunk = torch.tensor(ids[c * ctx:(c + 1) * ctx]).unsqueeze(0)
        if bos is not None:
            chunk[0, 0] = bos
        with torch.no_grad():
            logp = torch.log_softmax(model(chunk)[0].double(), -1)
        target = chunk[0, first + 1:]
        nll -= float(logp[first:ctx - 1].gather(1, target[:, None]).sum())
        count += target.numel()
    return float(torch.exp(torch.tensor(nll / count)))


def ggml_q4_0_model(folder: Path):
    """The float model with every decoder linear replaced by ggml's reference Q4_0 round trip."""
    import gguf

    from lmfoundry.model.config import LAYER_LINEARS
    from lmfoundry.runtime.loader import load_model

    model, _ = load_model(str(folder))
    q4 = gguf.GGMLQuantizationType.Q4_0
    with torch.no_grad():
        for _i, layer in enumerate(model.model.layers):
            for local in LAYER_LINEARS:
                lin = layer.get_submodule(local)
                w = lin.weight.detach().float().numpy()
                lin.weight.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, q4), q4)))
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="rtn,gptq,awq")
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--llama-cpp", default=None, help="llama.cpp source tree with build/bin/llama-perplexity "
                                                       "and llama-quantize")
    ap.add_argument("--reuse", action="store_true", help="keep the checkpoints an earlier run left in --workdir")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from lmfoundry.calibration.data import eval_token_stream
    from lmfoundry.calibration.job import QuantizeJob, run_job
    from lmfoundry.checkpoint.sources import resolve_model
    from lmfoundry.export.gguf import export_gguf
    from lmfoundry.recipe import Recipe
    from lmfoundry.runtime.loader import load_model

    work = Path(a.workdir or tempfile.mkdtemp(prefix="lmf-gguf-"))
    source = resolve_model("smollm2-135m")
    float_model, tok = load_model(str(source))
    stream, _, _ = eval_token_stream(None, tok)
    text_file = work / "eval.txt"  # the same held-out text for llama.cpp, as text
    # plain text: llama.cpp tokenizes a file without parsing special tokens, so a "<|im_start|>"
    # left in it would become five text tokens and shift every chunk (measured: +1.45 % on float)
    text_file.write_text(tok.decode(stream[: (a.windows + 1) * a.ctx].tolist(), skip_special_tokens=True))
    text_ids = tok(text_file.read_text(), add_special_tokens=False)["input_ids"]
    bos = tok.bos_token_id if getattr(tok, "add_bos_token", False) else None
    rows = [{"model": "float", "ppl": ppl_of(float_model, stream, a.ctx, a.windows)}]
    perplexity = str(Path(a.llama_cpp) / "build/bin/llama-perplexity") if a.llama_cpp else ""
    if a.llama_cpp:
        own = llama_cpp_q4_0(Path(a.llama_cpp), source, work)
        llama_own = llama_cpp_ppl(perplexity, own, text_file, a.ctx, a.windows)
        float_llama_way = ppl_like_llama_cpp(float_model, text_ids, bos, a.ctx, a.windows)
    del float_model
    rows.append({"model": "ggml Q4_0 (llama-quantize's algorithm)",
                 "ppl": ppl_of(ggml_q4_0_model(source), stream, a.ctx, a.windows)})
    for method in a.methods.split(","):
        rec = Recipe().with_overrides(method=method, scheme="w4a16", group_size=32, dtype="float16")
        rec = rec.with_overrides(num_samples=a.num_samples, seq_len=a.seq_len)
        ckpt = work / f"{method}-g32"
        t0 = time.time()
        if a.reuse and (ckpt / "lmfoundry.json").exists():
            quantize_s = float("nan")  # made by an earlier run of this script in the same --workdir
        else:
            run_job(QuantizeJob("smollm2-135m", ckpt, rec, overwrite=True, progress=False))
            quantize_s = time.time() - t0
        gguf_dir = work / f"{method}-gguf"
        report = export_gguf(ckpt, gguf_dir / "model.gguf", tokenizer_pre="smollm", progress=False)
        hf = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file="model.gguf", dtype=torch.float32).eval()
        exported = ppl_of(HFLogits(hf), stream, a.ctx, a.windows)
        del hf
        ours, _ = load_model(str(ckpt))
        direct = ppl_of(ours, stream, a.ctx, a.windows)
        row = {"model": f"ours {method} g32 -> Q4_0 .gguf (read by transformers)", "ppl": exported,
               "runtime_ppl": direct, "quantize_s": round(quantize_s, 1),
               "gguf_mib": round(report.bytes / 2**20, 1), "scale_rounding": report.max_scale_rounding}
        if a.llama_cpp:
            row["llama_cpp_ppl"] = llama_cpp_ppl(perplexity, gguf_dir / "model.gguf", text_file, a.ctx, a.windows)
            row["runtime_ppl_llama_cpp_way"] = ppl_like_llama_cpp(ours, text_ids, bos, a.ctx, a.windows)
        rows.append(row)
    base = rows[0]["ppl"]
    ggml = rows[1]["ppl"]
    lines = [
        f"SmolLM2-135M, {a.windows} held-out wiki windows x {a.ctx} tokens; calibration {a.num_samples} x "
        f"{a.seq_len} c4 tokens; decoder linears int4 symmetric group 32 (Q4_0), embeddings float.",
        "",
        "| model | ppl | +ppl over float | vs ggml Q4_0 | our runtime on the checkpoint | export vs runtime |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        rt = r.get("runtime_ppl")
        runtime = "" if rt is None else f"{rt:.3f}"
        agree = "" if rt is None else f"{(r['ppl'] - rt) / rt * 100:+.3f} %"
        lines.append(f"| {r['model']} | {r['ppl']:.3f} | {r['ppl'] - base:+.3f} | {r['ppl'] - ggml:+.3f} | "
                     f"{runtime} | {agree} |")
    if a.llama_cpp:
        lines += ["", f"llama.cpp ({perplexity}) on the same text, its own tokenizer and measure "
                  f"({a.windows} chunks x {a.ctx}, second half of each chunk scored), beside our runtime on the "
                  "checkpoint scored the same way:", "",
                  "| model | llama-perplexity on the .gguf | our runtime, same measure | difference |",
                  "|---|---|---|---|"]
        for r in rows:
            if "llama_cpp_ppl" in r:
                lc, rt = r["llama_cpp_ppl"], r["runtime_ppl_llama_cpp_way"]
                lines.append(f"| {r['model'].split(' .gguf')[0]} | {lc:.3f} | {rt:.3f} | {(lc - rt) / rt * 100:+.2f} % |")
        lines += ["", f"llama.cpp's own Q4_0 (convert_hf_to_gguf.py f32, llama-quantize Q4_0, token embedding f16) "
                  f"scored by llama-perplexity: {llama_own:.3f}; the float model, our runtime, same measure: "
                  f"{float_llama_way:.3f}.", "",
                  "| ours, scored by llama-perplexity | ppl | vs llama.cpp's own Q4_0 |", "|---|---|---|"]
        for r in rows:
            if "llama_cpp_ppl" in r:
                lc = r["llama_cpp_ppl"]
                lines.append(f"| {r['model'].split(' .gguf')[0]} | {lc:.3f} | {lc - llama_own:+.3f} |")
        rows.append({"model": "llama.cpp's own Q4_0 (llama-quantize)", "llama_cpp_ppl": llama_own,
                     "float_runtime_ppl_llama_cpp_way": float_llama_way})
    table = "\n".join(lines)
    print(table)
    if a.out:
        out = Path(a.out)
        out.write_text(f"# GGUF export (benchmarks/gguf_export.py)\n\n{table}\n")
        out.with_suffix(".json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
