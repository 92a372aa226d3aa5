"""The streaming GGUF converter (`lmfoundry.checkpoint.gguf_import`): the folder it writes holds
exactly the tensors `AutoModelForCausalLM.from_pretrained(gguf_file=...)` loads (same names, same
float32 values, or those values cast to bfloat16) and the same config, while its memory grows by
about one tensor plus one shard rather than by the whole model; and the conversion cache keys a
folder by how it was converted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lmfoundry.checkpoint import sources
from lmfoundry.checkpoint.gguf_import import INDEX_NAME, conversion_label, import_gguf
from lmfoundry.errors import UserError

# What the converted config.json may add to, or leave out of, the loaded model's config.
CONFIG_NOT_COMPARED = {"_name_or_path", "quantization_config", "architectures", "dtype", "torch_dtype"}


def write_gguf(path: Path, layers: int = 2, hidden: int = 128, inter: int = 256, tied: bool = True,
               skip: tuple[str, ...] = (), seed: int = 0) -> Path:
    """A random Llama-architecture GGUF with a SentencePiece-style vocabulary transformers loads:
    matrices stored as Q8_0 blocks (so they are dequantized), norms as F32 values around 1."""
    import gguf
    import numpy as np

    q8 = gguf.GGMLQuantizationType.Q8_0
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], "▁", "▁a"]
    heads, kv_heads = 4, 2
    kv = kv_heads * hidden // heads
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    metadata = {"context_length": 256, "embedding_length": hidden, "block_count": layers,
                "feed_forward_length": inter, "head_count": heads, "head_count_kv": kv_heads,
                "rope_dimension_count": hidden // heads, "layer_norm_rms_eps": 1e-5, "rope_freq_base": 10000.0,
                "vocab_size": len(tokens), "tokenizer_model": "llama", "token_list": tokens,
                "token_scores": [0.0] * len(tokens), "token_types": [2, 3, 3] + [6] * 256 + [1, 1],
                "bos_token_id": 1, "eos_token_id": 2, "unk_token_id": 0}
    for key, value in metadata.items():
        getattr(w, f"add_{key}")(value)

    def matrix(name: str, rows: int, cols: int) -> None:
        if name not in skip:
            values = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
            blocks = gguf.quants.quant_shape_to_byte_shape((rows, cols), q8)
            w.add_tensor(name, gguf.quants.quantize(values, q8), raw_shape=blocks, raw_dtype=q8)

    matrix("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        for name, rows, cols in [("attn_q", hidden, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden),
                                 ("attn_output", hidden, hidden), ("ffn_gate", inter, hidden),
                                 ("ffn_up", inter, hidden), ("ffn_down", hidden, inter)]:
            matrix(f"blk.{i}.{name}.weight", rows, cols)
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", (1 + rng.standard_normal(hidden) * 0.1).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    if not tied:
        matrix("output.weight", len(tokens), hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def converted_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for shard in sources.safetensors_files(folder):
        with safe_open(str(shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def assert_matches_from_pretrained(gguf: Path, folder: Path, dtype: torch.dtype) -> None:
    """`folder` (written by the converter, config.json included) holds what transformers loads
    from `gguf` in float32, cast to `dtype`, bit for bit, under the same names and config."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    want = model.state_dict()
    if model.config.tie_word_embeddings:
        want.pop("lm_head.weight")
    got = converted_tensors(folder)
    assert sorted(got) == sorted(want)
    differ = [k for k in want if got[k].dtype != dtype or not torch.equal(got[k], want[k].to(dtype))]
    assert differ == []
    cfg = json.loads((folder / "config.json").read_text())
    ref = json.loads(model.config.to_json_string(use_diff=False))
    assert {k: v for k, v in cfg.items() if k not in CONFIG_NOT_COMPARED} == \
        {k: v for k, v in ref.items() if k not in CONFIG_NOT_COMPARED}
    assert cfg["architectures"] == [type(model).__name__]
    assert cfg["dtype"] == cfg["torch_dtype"] == str(dtype).removeprefix("torch.")
    assert "quantization_config" not in cfg


def convert(gguf: Path, folder: Path, dtype_name: str, **kw) -> Path:
    folder.mkdir(parents=True)
    cfg = import_gguf(gguf, folder, dtype_name, **kw)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    return folder


def test_smollm2_float32_shards_hold_what_from_pretrained_loads(tmp_path, capsys) -> None:
    from lmfoundry.resources import SMOLLM2_GGUF, packaged_file

    gguf = packaged_file(SMOLLM2_GGUF)
    folder = convert(gguf, tmp_path / "smol", "float32", shard_bytes=128 << 20)
    index = json.loads((folder / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) == 5 and not (folder / "model.safetensors").exists()
    assert "shard 5:" in capsys.readouterr().err  # progress, on stderr
    assert_matches_from_pretrained(gguf, folder, torch.float32)


@pytest.mark.parametrize("tied", [True, False])
def test_bfloat16_is_the_float32_load_cast(tmp_path, tied) -> None:
    gguf = write_gguf(tmp_path / "tiny.gguf", tied=tied)
    folder = convert(gguf, tmp_path / "out", "bfloat16")
    assert (folder / "model.safetensors").is_file() and not (folder / INDEX_NAME).exists()  # one shard
    assert_matches_from_pretrained(gguf, folder, torch.bfloat16)
    assert ("lm_head.weight" in converted_tensors(folder)) is not tied


# Imports and converts a small GGUF first, so that the baseline holds everything a conversion
# loads once (modules, tokenizer code); then resets the high-water mark and converts the big one.
MEASURE = textwrap.dedent("""
    import gc, json, re, sys, tempfile
    from pathlib import Path
    from lmfoundry.checkpoint.gguf_import import import_gguf

    def status(key):
        return int(re.search(key + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) << 10

    with tempfile.TemporaryDirectory() as tmp:
        import_gguf(Path(sys.argv[1]), Path(tmp), "bfloat16")
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = status("VmHWM")
    import_gguf(Path(sys.argv[2]), Path(sys.argv[3]), "bfloat16", shard_bytes=int(sys.argv[4]))
    print(json.dumps({"base": base, "peak": status("VmHWM")}))
""")


def test_peak_memory_is_a_tensor_and_a_shard_not_the_model(tmp_path) -> None:
    layers, hidden, inter = 24, 512, 2048
    big = write_gguf(tmp_path / "big.gguf", layers=layers, hidden=hidden, inter=inter)
    largest = inter * hidden * 4  # an MLP matrix in float32
    whole = layers * (2 * hidden * hidden + 2 * hidden * hidden // 2 + 3 * inter * hidden) * 4
    assert whole >= 10 * largest
    shard = 8 << 20
    (tmp_path / "out").mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(write_gguf(tmp_path / "warm.gguf", layers=1)),
                           str(big), str(tmp_path / "out"), str(shard)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    grown = r["peak"] - r["base"]
    assert grown < whole / 4, (grown, whole)
    assert grown < 4 * largest + 2 * shard + (16 << 20), (grown, largest, shard)
    assert len(json.loads((tmp_path / "out" / INDEX_NAME).read_text())["weight_map"]) == 1 + layers * 9 + 1


def test_a_gguf_missing_a_weight_is_one_error_and_nothing_is_published(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LMFOUNDRY_CACHE", str(tmp_path / "cache"))
    gguf = write_gguf(tmp_path / "holey.gguf", skip=("blk.1.ffn_down.weight",))
    with pytest.raises(UserError, match=r"no tensor for 1 weights .*model.layers.1.mlp.down_proj.weight") as exc:
        sources.resolve_model(gguf)
    assert "\n" not in str(exc.value)
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir() if not p.name.endswith(".lock")] == []


def test_the_cache_keys_a_folder_by_converter_and_dtype(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("LMFOUNDRY_CACHE", str(tmp_path / "cache"))
    gguf = write_gguf(tmp_path / "tiny.gguf")
    digest = sources.file_sha256(gguf)
    folder = sources.resolve_model(gguf)
    record = f"sha256 {digest} {conversion_label('bfloat16')}"
    assert record in (folder / sources.SOURCE).read_text().splitlines()
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in converted_tensors(folder).values()} == {torch.bfloat16}
    capsys.readouterr()
    assert sources.resolve_model(gguf) == folder and "converting" not in capsys.readouterr().err  # reused

    # made by an older converter: converted again
    (folder / sources.SOURCE).write_text((folder / sources.SOURCE).read_text().replace("gguf-import/", "gguf-import/0"))
    assert sources.resolve_model(gguf) == folder and "converting tiny.gguf" in capsys.readouterr().err
    assert record in (folder / sources.SOURCE).read_text().splitlines()

    # asked for in another dtype: converted again, in that dtype
    monkeypatch.setattr(sources, "GGUF_DTYPE", "float32")
    assert sources.resolve_model(gguf) == folder and "to float32 safetensors" in capsys.readouterr().err
    assert {t.dtype for t in converted_tensors(folder).values()} == {torch.float32}


def assert_builtin_matches(name: str) -> None:
    from lmfoundry.resources import packaged_file

    folder = sources.resolve_model(name)
    gguf = packaged_file(sources.BUILTIN_MODELS[name])
    assert_matches_from_pretrained(gguf, folder, torch.bfloat16)


@pytest.mark.slow
def test_qwen25_coder_bfloat16_is_the_float32_load_cast() -> None:
    assert_builtin_matches("qwen2.5-coder-0.5b")


@pytest.mark.slow
def test_gemma3_bfloat16_is_the_float32_load_cast() -> None:
    assert_builtin_matches("gemma3-270m")
