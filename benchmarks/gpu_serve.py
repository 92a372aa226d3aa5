"""The serving runtime on a GPU, end to end: an engine bundle's kernels against torch on the same GPU.

    python benchmarks/gpu_serve.py                       # ~1B-class random Llama, W4A16 g128
    python benchmarks/gpu_serve.py --preset tiny --out benchmarks/results/gpu_serve_h200.md

One prepared script for a lent GPU (budget: well under 8 minutes on an H100/H200):
1. writes a random Llama-shaped W4A16 (g128, symmetric) compressed-tensors checkpoint and the
   same weights dequantized to a dense bf16 checkpoint (no download, no calibration: the kernels'
   speed and correctness do not depend on the weights' values);
2. compiles the W4A16 checkpoint into an engine bundle for this GPU's arch (`build_engine`);
3. checks the bundle on CUDA (graphs on) against the same bundle on CPU with each kernel's PyTorch
   reference: greedy tokens on 3 prompts must be equal, and the kernel set must report zero
   Triton JIT calls (every call from a shipped cubin);
4. measures decode tokens/s at batch 1, 16 and 64 (prompt 128, 128 new tokens) for: the kernel
   executor with CUDA graphs, without graphs, the same model dense in torch eager bf16 (the
   reference `CausalLM` with a contiguous KV cache), and that torch model under torch.compile;
   plus resident weight bytes (W4A16 vs dense bf16);
5. optionally (`--serve`) starts `lmfoundry serve BUNDLE --device cuda` and runs `lmfoundry bench`
   (benchmarks/gpu_http.py).
Prints a markdown table (and writes it with --out); `--json FILE` gets the same figures as data,
rewritten after each part so a run cut short keeps what it measured (the JIT count first).
`--tokenizer DIR` puts DIR's tokenizer in the checkpoint (the vocabulary grows to cover it), which
`serve` needs; `--keep DIR` builds the bundle in DIR and leaves it there (the GPU lease's HTTP step
serves it). Runs from a checkout without installing lmfoundry.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import _bootstrap_import  # noqa: E402  (maps the lmfoundry package folders)

_bootstrap_import()

import torch  # noqa: E402

PRESETS = {
    "tiny": dict(hidden=512, inter=1536, layers=4, heads=8, kv=2, vocab=8192),
    "1b": dict(hidden=2048, inter=8192, layers=16, heads=32, kv=8, vocab=32000),
}


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors pack-quantized layout: 8 signed 4-bit codes per int32 along K."""
    u = (q.to(torch.int32) + 8).reshape(q.shape[0], -1, 8)
    words = (u << (torch.arange(8, dtype=torch.int32) * 4)).sum(-1, dtype=torch.int64)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tokenizer_vocab(folder: Path) -> int:
    """Token ids the tokenizer in `folder` can produce (added tokens included), rounded up to 64."""
    from transformers import AutoTokenizer

    return -(-len(AutoTokenizer.from_pretrained(str(folder))) // 64) * 64


def write_models(root: Path, p: dict, group: int = 128, seed: int = 0,
                 tokenizer: Path | None = None) -> tuple[Path, Path]:
    """(W4A16 folder, dense bf16 folder) with the same effective weights; with `tokenizer`, both
    hold its files and the vocabulary covers it."""
    from safetensors.torch import save_file

    from lmfoundry.kernels.w4a16 import dequantize

    gen = torch.Generator().manual_seed(seed)
    h, i, nl, hq, hkv, v, d = p["hidden"], p["inter"], p["layers"], p["heads"], p["kv"], p["vocab"], 64
    if tokenizer is not None:
        v = max(v, tokenizer_vocab(tokenizer))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "intermediate_size": i,
           "num_attention_heads": hq, "num_key_value_heads": hkv, "head_dim": d, "num_hidden_layers": nl,
           "vocab_size": v, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16", "rope_theta": 500000.0, "bos_token_id": 1, "eos_token_id": 2}
    shapes = {"self_attn.q_proj": (hq * d, h), "self_attn.k_proj": (hkv * d, h), "self_attn.v_proj": (hkv * d, h),
              "self_attn.o_proj": (h, hq * d), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    common = {"model.embed_tokens.weight": (torch.randn(v, h, generator=gen) * 0.5).bfloat16(),
              "model.norm.weight": torch.ones(h).bfloat16(),
              "lm_head.weight": (torch.randn(v, h, generator=gen) / h**0.5 * 4).bfloat16()}
    quant, dense = dict(common), dict(common)
    for layer in range(nl):
        pre = f"model.layers.{layer}."
        for t in (quant, dense):
            t[pre + "input_layernorm.weight"] = torch.ones(h).bfloat16()
            t[pre + "post_attention_layernorm.weight"] = torch.ones(h).bfloat16()
        for local, (n, k) in shapes.items():
            q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
            scale = (torch.rand(n, k // group, generator=gen) * 0.5 + 0.75) / (8 * k**0.5)
            packed, scale = pack_int4(q), scale.bfloat16()
            quant[pre + local + ".weight_packed"] = packed
            quant[pre + local + ".weight_scale"] = scale
            quant[pre + local + ".weight_shape"] = torch.tensor([n, k])
            dense[pre + local + ".weight"] = dequantize(packed, scale, None, None, 4, group, k).bfloat16()
    qcfg = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group", "group_size": group}}}}
    out = []
    for name, tensors, extra in (("w4a16", quant, {"quantization_config": qcfg}), ("dense", dense, {})):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps({**cfg, **extra}, indent=1))
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        for f in TOKENIZER_FILES if tokenizer is not None else ():
            if (tokenizer / f).is_file():
                (folder / f).write_bytes((tokenizer / f).read_bytes())
        out.append(folder)
    return out[0], out[1]


def dense_model(folder: Path):
    """The reference `CausalLM` of a tokenizer-less folder, in bf16 on CPU."""
    from lmfoundry.checkpoint.folder import CheckpointReader
    from lmfoundry.runtime.checkpoint_model import load_causal_lm

    return load_causal_lm(CheckpointReader(folder), torch.bfloat16)


class ContiguousCache:
    """Attention context for the torch baselines: a preallocated [B, L, Hkv, D] cache per layer,
    written at the step's positions; decode attends over a fixed-length masked window (static
    shapes, so torch.compile compiles one graph)."""

    def __init__(self, cfg, batch: int, length: int, device: str) -> None:
        shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(cfg.num_layers)]
        self.pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.length = length

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b = self.pos.shape[0]
        rows = torch.arange(b, device=q.device)
        self.k[layer][rows, self.pos] = k.view(b, *k.shape[-2:])
        self.v[layer][rows, self.pos] = v.view(b, *v.shape[-2:])
        mask = torch.arange(self.length, device=q.device)[None, :] <= self.pos[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            q.view(b, -1, q.shape[-1]).unsqueeze(2), self.k[layer].transpose(1, 2), self.v[layer].transpose(1, 2),
            attn_mask=mask[:, None, None, :], enable_gqa=True)
        return o.squeeze(2).reshape(q.shape)


def torch_decode_tok_s(dense: Path, batch: int, prompt: int, new: int, compiled: bool) -> float:
    """Decode tok/s of the dense bf16 reference model in torch (eager or torch.compile)."""
    model = dense_model(dense).cuda()
    cache = ContiguousCache(model.config, batch, prompt + new + 1, "cuda")

    def step(ids: torch.Tensor) -> torch.Tensor:
        hidden = model.hidden_states(ids.view(-1), cache.pos.clone(), cache)
        return model.lm_head(hidden).argmax(-1)

    fn = torch.compile(step, dynamic=False) if compiled else step
    ids = torch.randint(3, model.config.vocab_size, (batch,), device="cuda")
    with torch.inference_mode():
        for p in range(prompt):  # fill the cache token by token (same kernels as decode)
            cache.pos.fill_(p)
            ids = fn(ids)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for p in range(prompt, prompt + new):
            cache.pos.fill_(p)
            ids = fn(ids)
        torch.cuda.synchronize()
    return batch * new / (time.perf_counter() - t0)


def engine_decode_tok_s(bundle: Path, batch: int, prompt: int, new: int, graphs: bool) -> tuple[float, dict]:
    from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
    from lmfoundry.runtime.loader import load_bundle

    model, _ = load_bundle(bundle, "cuda")
    engine = LLMEngine(model, None, EngineConfig(block_size=model.block_size, kv_cache_memory_gb=4.0,
                                                 max_num_seqs=batch, max_num_batched_tokens=batch * prompt,
                                                 max_model_len=prompt + new + 8, cuda_graphs=graphs))
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, model.config.vocab_size, (prompt,), generator=gen).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    for rid, ids in enumerate(prompts):
        engine.add_request(f"r{rid}", ids, params)
    engine.step()  # the prefill step (all prompts fit one step)
    torch.cuda.synchronize()
    t0, produced = time.perf_counter(), 0
    while engine.has_unfinished():
        produced += len(engine.step())
    torch.cuda.synchronize()
    return produced / (time.perf_counter() - t0), dict(model.kernels.stats)


def check_tokens(bundle: Path, tokens: int = 8) -> tuple[bool, dict]:
    """Greedy tokens on CUDA (graphs on) vs the bundle's kernel references on CPU."""
    from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
    from lmfoundry.runtime.loader import load_bundle

    prompts = [[1, 5, 9, 33, 70, 8], [1, 40, 41, 42], [1, *range(100, 130)]]
    params = SamplingParams(max_tokens=tokens, temperature=0)
    outs = []
    for device, interpret in (("cpu", False), ("cuda", None)):
        model, _ = load_bundle(bundle, device, interpret=interpret)
        engine = LLMEngine(model, None, EngineConfig(block_size=model.block_size, num_kv_blocks=64))
        outs.append([o.outputs[0].token_ids for o in engine.generate(prompts, params)])
    return outs[0] == outs[1], dict(model.kernels.stats)


def build_bundle(preset: str, root: Path, arch: str, tokenizer: Path | None = None,
                 bundle_dir: Path | None = None) -> tuple[Path, Path]:
    """(bundle, dense bf16 folder): the random W4A16 checkpoint of `preset` compiled for `arch`."""
    from lmfoundry.compile.bundle import build_engine

    quant, dense = write_models(root, PRESETS[preset], tokenizer=tokenizer)
    return build_engine(quant, [arch], bundle_dir or root / "engine", progress=False).output, dense


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=list(PRESETS), default="1b")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--serve", action="store_true", help="also run `lmfoundry bench` against `serve --device cuda`")
    ap.add_argument("--tokenizer", type=Path, default=None, help="folder whose tokenizer the checkpoint gets")
    ap.add_argument("--keep", type=Path, default=None, help="build the bundle in this folder and keep it")
    ap.add_argument("--out", help="write the markdown table here")
    ap.add_argument("--json", type=Path, default=None, help="write the figures as JSON here (after each part)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")

    cap = torch.cuda.get_device_capability()
    arch = {(8, 0): "ampere", (8, 9): "ada", (9, 0): "hopper"}.get(cap, "hopper")
    lines = [f"# gpu_serve: {torch.cuda.get_device_name()} ({arch}), preset {args.preset}, torch {torch.__version__}", ""]
    record: dict = {"gpu": torch.cuda.get_device_name(), "arch": arch, "preset": args.preset,
                    "torch": torch.__version__, "decode": []}

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(record, indent=1))

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        bundle, dense = build_bundle(args.preset, root, arch, args.tokenizer, args.keep)
        record["bundle"] = str(bundle)
        record["build_s"] = time.perf_counter() - t0
        lines.append(f"- checkpoint + bundle built in {record['build_s']:.1f} s")
        same, stats = check_tokens(bundle)
        record.update(tokens_equal=same, check_kernel_calls=stats, jit_calls=stats.get("jit", 0))
        save()
        lines.append(f"- greedy tokens CUDA vs CPU kernel references: {'equal' if same else 'DIFFER'}; "
                     f"kernel calls {stats} (JIT calls must be 0)")
        from lmfoundry.runtime.loader import load_bundle

        kmodel, _ = load_bundle(bundle, "cuda")
        ref = dense_model(dense)
        dense_bytes = sum(p.numel() * p.element_size() for n, p in ref.named_parameters() if "layers." in n)
        packed = kmodel.weight_bytes() - sum(t.numel() * t.element_size() for t in
                                             (kmodel.embed, kmodel.final_norm, kmodel.lm_head.dense))
        record.update(w4a16_decoder_bytes=packed, dense_decoder_bytes=dense_bytes)
        lines.append(f"- decoder weights resident: W4A16 {packed / 2**20:.1f} MiB vs dense bf16 "
                     f"{dense_bytes / 2**20:.1f} MiB = {packed / dense_bytes:.3f} x")
        del kmodel, ref
        lines += ["", "| batch | kernels + graphs | kernels eager | torch eager bf16 | torch.compile bf16 | "
                  "graphs / eager torch | graphs / compile |", "|---|---|---|---|---|---|---|"]
        for b in (int(x) for x in args.batches.split(",")):
            g, gstats = engine_decode_tok_s(bundle, b, args.prompt, args.new, True)
            e, estats = engine_decode_tok_s(bundle, b, args.prompt, args.new, False)
            record["jit_calls"] += gstats.get("jit", 0) + estats.get("jit", 0)
            row = {"batch": b, "graphs_tok_s": g, "eager_tok_s": e, "graphs_kernel_calls": gstats,
                   "eager_kernel_calls": estats}
            record["decode"].append(row)
            save()
            row["torch_eager_tok_s"] = te = torch_decode_tok_s(dense, b, args.prompt, args.new, False)
            save()
            row["torch_compile_tok_s"] = tc = torch_decode_tok_s(dense, b, args.prompt, args.new, True)
            save()
            lines.append(f"| {b} | {g:.0f} | {e:.0f} | {te:.0f} | {tc:.0f} | {g / te:.2f} | {g / tc:.2f} |")
            print(lines[-1], gstats, flush=True)
        if args.serve:
            from gpu_http import serve_and_bench

            result = serve_and_bench(bundle, "cuda", [1, 16, 64], root / "bench.json")
            record["http"] = result
            save()
            lines += ["", "```", json.dumps(result["levels"], indent=1), "```"]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
