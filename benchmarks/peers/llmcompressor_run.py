"""Run llm-compressor's oneshot on the float model with the exact calibration token ids lmfoundry
uses; runs inside the llm-compressor side venv.

Methods (each is llm-compressor's own recipe for the scheme, with its defaults unless stated):
  gptq              GPTQModifier, int4 weights (group --group-size), actorder static (its default)
  awq               AWQModifier + QuantizationModifier, int4 weights (group --group-size)
  smoothquant-w8a8  SmoothQuantModifier(smoothing_strength) + GPTQModifier(scheme="W8A8"): int8
                    per-channel symmetric weights, int8 dynamic per-token activations
  fp8-dynamic       QuantizationModifier(scheme="FP8_DYNAMIC"): fp8 e4m3 per-channel weights,
                    dynamic per-token activations; data-free (no calibration pass) unless a KV
                    cache scheme needs one
--kv-cache fp8|int8 adds `kv_cache_scheme` (8 bits, per tensor, static, symmetric) to the
quantization modifier, calibrated on the same ids. lm_head is never quantized.

Writes its compressed-tensors checkpoint to --out and {"cpu_s", "wall_s", "peak_rss"} to
--out/peer_stats.json. lmfoundry then scores the checkpoint with its own loader and perplexity.
"""

import argparse
import json
import time
from pathlib import Path

import torch
from _proc import peak_rss_bytes

KV_TYPES = {"fp8": "float", "int8": "int"}


def kv_cache_scheme(kind: str) -> dict | None:
    if kind == "none":
        return None
    return {"num_bits": 8, "type": KV_TYPES[kind], "strategy": "tensor", "dynamic": False, "symmetric": True}


def build_recipe(a: argparse.Namespace) -> list:
    """llm-compressor modifiers for `a.method` (imports inside: the side venv only)."""
    kv = kv_cache_scheme(a.kv_cache)
    weights = {"num_bits": 4, "type": "int", "symmetric": not a.asym, "strategy": "group",
               "group_size": a.group_size}
    groups = {"group_0": {"targets": ["Linear"], "weights": weights}}
    if a.method == "gptq":
        from llmcompressor.modifiers.gptq import GPTQModifier

        actorder = None if a.actorder in ("none", "None") else a.actorder
        return [GPTQModifier(config_groups=groups, ignore=["lm_head"], dampening_frac=0.01,
                             block_size=128, actorder=actorder, kv_cache_scheme=kv)]
    if a.method == "awq":
        # RESOURCES.md: AWQModifier pins intermediates to page-locked memory, which raises
        # "Cannot access accelerator device" on CPU-only machines; pinning is only an H2D
        # transfer optimisation, so make it a no-op.
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from llmcompressor.modifiers.transform.awq import AWQModifier

        # 0.14: AWQ only smooths; a QuantizationModifier after it produces the checkpoint
        return [AWQModifier(), QuantizationModifier(config_groups=groups, ignore=["lm_head"], kv_cache_scheme=kv)]
    if a.method == "smoothquant-w8a8":
        from llmcompressor.modifiers.gptq import GPTQModifier
        from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

        # the W8A8 example of llm-compressor: smoothing, then GPTQ with the W8A8 preset
        return [SmoothQuantModifier(smoothing_strength=a.smoothing_strength),
                GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"], kv_cache_scheme=kv)]
    if a.method == "fp8-dynamic":
        from llmcompressor.modifiers.quantization import QuantizationModifier

        return [QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"], kv_cache_scheme=kv)]
    raise SystemExit(f"unknown method {a.method}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True, help="torch.save'd int64 [n, seq] calibration ids")
    ap.add_argument("--method", choices=["gptq", "awq", "smoothquant-w8a8", "fp8-dynamic"], required=True)
    ap.add_argument("--group-size", type=int, default=64, help="gptq/awq int4 group size")
    ap.add_argument("--asym", action="store_true", help="gptq/awq: asymmetric int4 weights")
    ap.add_argument("--actorder", default="static", help="GPTQ actorder (llm-compressor default: static)")
    ap.add_argument("--smoothing-strength", type=float, default=0.5, help="smoothquant-w8a8: SmoothQuant alpha")
    ap.add_argument("--kv-cache", choices=["none", *KV_TYPES], default="none",
                    help="add a static per-tensor 8-bit kv_cache_scheme")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0, c0 = time.time(), time.process_time()

    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(a.model)
    recipe = build_recipe(a)
    data_free = a.method == "fp8-dynamic" and a.kv_cache == "none"
    if data_free:  # nothing to calibrate: llm-compressor's FP8_DYNAMIC example passes no data
        oneshot(model=model, recipe=recipe)
    else:
        ids = torch.load(a.ids)
        ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
        oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=ids.shape[0],
                max_seq_length=ids.shape[1], shuffle_calibration_samples=False, pipeline="sequential")
    out = Path(a.out)
    model.save_pretrained(str(out), save_compressed=True)
    tok.save_pretrained(str(out))
    stats = {"cpu_s": time.process_time() - c0, "wall_s": time.time() - t0, "data_free": data_free,
             "peak_rss": peak_rss_bytes()}
    (out / "peer_stats.json").write_text(json.dumps(stats))


if __name__ == "__main__":
    main()
