"""Run GPTQModel (GPTQ) on the float model with lmfoundry's calibration token ids; runs inside the
GPTQModel side venv.

GPTQModel writes its own GPTQ format (qweight/qzeros/scales/g_idx), which lmfoundry's loader does
not read, so after quantizing we reload the result with GPTQModel itself and export every
quantized linear as its dequantized dense weight (computed by GPTQModel's own kernel) into a float
folder; lmfoundry scores that folder, so both sides use one perplexity code path. Stats of the
quantization alone (not the export) go to --out/peer_stats.json.
"""

import argparse
import json
import os
import shutil
import time
from pathlib import Path

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # RESOURCES.md: dies at start-up otherwise

import torch
from _proc import peak_rss_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--asym", action="store_true")
    ap.add_argument("--desc-act", action="store_true")
    ap.add_argument("--out", required=True, help="dense (dequantized) float folder for scoring")
    ap.add_argument("--stage", choices=["quantize", "export"], required=True,
                    help="run separately so the quantize stage is timed alone")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.stage == "export":
        export(a)
        return
    t0, c0 = time.time(), time.process_time()
    from gptqmodel import GPTQModel, QuantizeConfig

    ids = torch.load(a.ids)
    calib = [{"input_ids": row.tolist(), "attention_mask": [1] * row.numel()} for row in ids]
    cfg = QuantizeConfig(bits=4, group_size=a.group_size, sym=not a.asym, desc_act=a.desc_act)
    model = GPTQModel.load(a.model, cfg, dtype=torch.float32, device="cpu")
    model.quantize(calib, batch_size=1)
    qdir = Path(a.out + ".gptq")
    model.save(str(qdir))
    stats = {"cpu_s": time.process_time() - c0, "wall_s": time.time() - t0,
             "peak_rss": peak_rss_bytes()}
    (qdir / "peer_stats.json").write_text(json.dumps(stats))


def export(a) -> None:
    """Dequantize with GPTQModel's own kernel and overlay on the float state dict."""
    from gptqmodel import GPTQModel
    from safetensors.torch import load_file, save_file

    qdir = Path(a.out + ".gptq")
    stats = json.loads((qdir / "peer_stats.json").read_text())

    qmodel = GPTQModel.load(str(qdir), device="cpu", dtype=torch.float32)
    dense = {}
    for name, mod in qmodel.model.named_modules():
        if hasattr(mod, "dequantize_weight") and hasattr(mod, "qweight"):
            w = mod.dequantize_weight().float()
            if w.shape == (mod.in_features, mod.out_features):
                w = w.t()
            dense[name + ".weight"] = w.contiguous()
    src = Path(a.model)
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    replaced = [k for k in dense if k in state]
    if len(replaced) != len(dense) or not dense:
        raise SystemExit(f"export mismatch: {len(dense)} dequantized, {len(replaced)} matched")
    state.update(dense)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file() and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)
    stats["exported_linears"] = len(dense)
    (out / "peer_stats.json").write_text(json.dumps(stats))


if __name__ == "__main__":
    main()
