"""Run llm-compressor's oneshot (GPTQModifier or AWQModifier) on the float model with the exact
calibration token ids lmfoundry uses; runs inside the llm-compressor side venv.

Writes its compressed-tensors checkpoint to --out and {"cpu_s", "wall_s", "peak_rss"} to
--out/peer_stats.json. lmfoundry then scores the checkpoint with its own loader and perplexity.
"""

import argparse
import json
import resource
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True, help="torch.save'd int64 [n, seq] calibration ids")
    ap.add_argument("--method", choices=["gptq", "awq"], required=True)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--asym", action="store_true")
    ap.add_argument("--actorder", default="static", help="GPTQ actorder (llm-compressor default: static)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0, c0 = time.time(), time.process_time()

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmcompressor import oneshot

    ids = torch.load(a.ids)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(a.model)
    weights = {"num_bits": 4, "type": "int", "symmetric": not a.asym, "strategy": "group",
               "group_size": a.group_size}
    groups = {"group_0": {"targets": ["Linear"], "weights": weights}}
    if a.method == "gptq":
        from llmcompressor.modifiers.gptq import GPTQModifier

        actorder = None if a.actorder in ("none", "None") else a.actorder
        recipe = GPTQModifier(config_groups=groups, ignore=["lm_head"], dampening_frac=0.01,
                              block_size=128, actorder=actorder)
    else:
        # RESOURCES.md: AWQModifier pins intermediates to page-locked memory, which raises
        # "Cannot access accelerator device" on CPU-only machines; pinning is only an H2D
        # transfer optimisation, so make it a no-op.
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from llmcompressor.modifiers.transform.awq import AWQModifier

        # 0.14: AWQ only smooths; a QuantizationModifier after it produces the checkpoint
        recipe = [AWQModifier(), QuantizationModifier(config_groups=groups, ignore=["lm_head"])]
    oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=ids.shape[0],
            max_seq_length=ids.shape[1], shuffle_calibration_samples=False, pipeline="sequential")
    out = Path(a.out)
    model.save_pretrained(str(out), save_compressed=True)
    tok.save_pretrained(str(out))
    stats = {"cpu_s": time.process_time() - c0, "wall_s": time.time() - t0,
             "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    (out / "peer_stats.json").write_text(json.dumps(stats))


if __name__ == "__main__":
    main()
