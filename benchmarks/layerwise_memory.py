"""Layer-wise memory: quantizing a model larger than the default keeps peak RSS at about one layer.

Writes a random-initialized Llama-family checkpoint (~2 GB of float32 weights by default), shard
by shard so the writer itself stays small, then runs `lmfoundry quantize` on it in a fresh process
and compares that process's peak RSS with its baseline (the RSS after imports, before any model
work) and with the checkpoint size. Bound: peak < baseline + 0.5 x checkpoint bytes.

    python benchmarks/layerwise_memory.py [--layers 8] [--hidden 2048] [--method rtn]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from lmfoundry.child_python import python_command


def write_random_llama(folder: Path, layers: int, hidden: int, intermediate: int, vocab: int,
                       kv_heads: int | None = None, dtype: torch.dtype = torch.float32,
                       rope_theta: float = 10000.0, tokenizer: Path | None = None) -> int:
    """Write the checkpoint one layer per shard (so the writer itself stays at one layer); returns
    the total tensor bytes. `kv_heads` < hidden/128 gives grouped-query attention (Llama-3).
    `tokenizer`: a folder whose tokenizer files are copied (default: the default model's, which
    may be fetched once; a machine with no network passes a copy)."""
    heads = hidden // 128
    kv_heads = kv_heads or heads
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 128,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "rope_theta": rope_theta, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        nonlocal total
        save_file(tensors, str(folder / name))
        for k, v in tensors.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=dtype) / shape[-1] ** 0.5).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    shard("embed.safetensors", {"model.embed_tokens.weight": rnd(vocab, hidden)})
    for i in range(layers):
        p = f"model.layers.{i}"
        shard(f"layer-{i:03d}.safetensors", {
            f"{p}.input_layernorm.weight": ones(hidden),
            f"{p}.post_attention_layernorm.weight": ones(hidden),
            f"{p}.self_attn.q_proj.weight": rnd(hidden, hidden),
            f"{p}.self_attn.k_proj.weight": rnd(kv_heads * 128, hidden),
            f"{p}.self_attn.v_proj.weight": rnd(kv_heads * 128, hidden),
            f"{p}.self_attn.o_proj.weight": rnd(hidden, hidden),
            f"{p}.mlp.gate_proj.weight": rnd(intermediate, hidden),
            f"{p}.mlp.up_proj.weight": rnd(intermediate, hidden),
            f"{p}.mlp.down_proj.weight": rnd(hidden, intermediate),
        })
    shard("head.safetensors", {"model.norm.weight": ones(hidden), "lm_head.weight": rnd(vocab, hidden)})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                      "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    # a tokenizer: borrow the default model's (same vocab size is not required for RTN)
    if tokenizer is None:
        from lmfoundry.checkpoint.sources import resolve_model

        tokenizer = resolve_model("smollm2-135m")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folder / f).write_bytes((tokenizer / f).read_bytes())
    return total


def measure(layers: int = 8, hidden: int = 2048, intermediate: int = 5632, vocab: int = 32000,
            method: str = "rtn", workdir: Path | None = None) -> dict:
    workdir = Path(workdir or tempfile.mkdtemp(prefix="lmf-mem-"))
    src = workdir / "random-llama"
    t0 = time.time()
    size = write_random_llama(src, layers, hidden, intermediate, vocab)
    write_s = time.time() - t0
    out = workdir / "quantized"
    cmd = python_command("lmfoundry.cli", "quantize", str(src), "-o", str(out), "--overwrite", "--quiet",
                         "--method", method, "--scheme", "w4a16", "--group-size", "128", "--num-samples", "4",
                         "--seq-len", "128")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    run = json.loads((out / "lmfoundry-run.json").read_text())  # the run record: times and RSS
    row = {
        "checkpoint_bytes": size, "layers": layers, "hidden": hidden, "method": method,
        "baseline_rss_bytes": run["baseline_rss_bytes"], "peak_rss_bytes": run["peak_rss_bytes"],
        "bound_bytes": run["baseline_rss_bytes"] + size // 2, "quantize_wall_s": run["wall_s"],
        "write_s": round(write_s, 1),
    }
    row["within_bound"] = row["peak_rss_bytes"] < row["bound_bytes"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--method", default="rtn")
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()
    r = measure(a.layers, a.hidden, a.intermediate, method=a.method, workdir=a.workdir)
    mib = 2**20
    print("| checkpoint | baseline RSS | peak RSS | peak - baseline | bound (baseline + ckpt/2) | ratio (peak-base)/ckpt | quantize s |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {r['checkpoint_bytes'] / mib:.0f} MiB | {r['baseline_rss_bytes'] / mib:.0f} MiB | {r['peak_rss_bytes'] / mib:.0f} MiB"
          f" | {(r['peak_rss_bytes'] - r['baseline_rss_bytes']) / mib:.0f} MiB | {r['bound_bytes'] / mib:.0f} MiB"
          f" | {(r['peak_rss_bytes'] - r['baseline_rss_bytes']) / r['checkpoint_bytes']:.3f} | {r['quantize_wall_s']} |")
    print("within bound:", r["within_bound"])


if __name__ == "__main__":
    main()
