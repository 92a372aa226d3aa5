"""Resolve what the user names as a model into a local Hugging Face folder we can stream from.

Accepted: a local HF folder (config.json + safetensors), a GGUF file, or the name `smollm2-135m`
(the embedded default). GGUF files are dequantized once by transformers and cached as float
safetensors, so every later stage reads tensors lazily through safetensors memory maps. Pickle
checkpoints (`*.bin`, `*.pt`) execute code on load and are refused unless the user opts in.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

from lmfoundry.errors import UserError
from lmfoundry.manifest import sha256_file as file_sha256
from lmfoundry.resources import SMOLLM2_GGUF, cache_dir, packaged_file
from lmfoundry.runtime.config import ModelConfig

DEFAULT_MODEL = "smollm2-135m"
BUILTIN_MODELS = {DEFAULT_MODEL: SMOLLM2_GGUF}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def resolve_model(spec: str | os.PathLike, allow_pickle: bool = False) -> Path:
    """Return a validated local folder holding config.json, tokenizer files and safetensors."""
    spec = str(spec)
    if spec in BUILTIN_MODELS:
        return _converted_gguf(packaged_file(BUILTIN_MODELS[spec]), name=spec)
    path = Path(spec).expanduser()
    if not path.exists():
        hint = f" (built-in models: {', '.join(BUILTIN_MODELS)})" if os.sep not in spec else ""
        raise UserError(f"{spec}: no such file or folder{hint}")
    if path.is_file():
        if path.suffix == ".gguf":
            return _converted_gguf(path, name=None)
        if path.suffix in PICKLE_SUFFIXES:
            raise UserError(f"{path}: pickle checkpoints are not loaded; pass the model folder"
                            " (with --allow-pickle to convert its *.bin files) or a safetensors model")
        raise UserError(f"{path}: expected a model folder, a .gguf file, or a built-in model name")
    ModelConfig.from_file(path)  # architecture check before any work
    shards = safetensors_files(path)
    if not shards:
        pickles = [p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if not pickles:
            raise UserError(f"{path}: no *.safetensors weights found")
        if not allow_pickle:
            raise UserError(
                f"{path}: only pickle weights ({pickles[0].name}); pickle files can run code when "
                "loaded. Re-run with --allow-pickle to convert them to safetensors once."
            )
        return _converted_pickle(path, pickles)
    for shard in shards:
        validate_safetensors(shard)
    return path


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a folder: from model.safetensors.index.json if present."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise UserError(f"{index}: unreadable index ({exc})") from None
        files = sorted({folder / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise UserError(f"{folder}: index names missing shard(s): {', '.join(missing[:3])}")
        return files
    return sorted(folder.glob("*.safetensors"))


def validate_safetensors(path: Path) -> dict[str, Any]:
    """Check a safetensors file's header against its size (catches truncated downloads)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise UserError(f"{path}: truncated safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 << 20:
            raise UserError(f"{path}: truncated or corrupt safetensors header")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{path}: corrupt safetensors header") from None
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise UserError(f"{path}: truncated safetensors file ({size} bytes, header needs {8 + n + end})")
    return header


def _converted_gguf(gguf: Path, name: str | None) -> Path:
    """Dequantize a GGUF once into a float32 safetensors folder in the cache (atomic)."""
    key = name or f"gguf-{file_sha256(gguf)[:16]}"
    target = cache_dir() / "models" / key
    if (target / "config.json").exists():
        return target
    print(f"converting {gguf.name} to float safetensors in {target} (once) ...", file=sys.stderr)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for unreadable GGUF
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"{gguf}: could not load GGUF ({type(exc).__name__}: {exc})") from None
    ModelConfig.from_dict(model.config.to_dict())
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    cfg["architectures"] = [type(model).__name__]
    cfg["torch_dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "SOURCE").write_text(f"{gguf.name}\nsha256 {file_sha256(gguf)}\n")
    del model, state
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


def _converted_pickle(folder: Path, pickles: list[Path]) -> Path:
    """Opt-in conversion of pickle weights to safetensors (weights_only loading, in the cache)."""
    import torch
    from safetensors.torch import save_file

    target = cache_dir() / "models" / f"pickle-{hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]}"
    if (target / "config.json").exists():
        return target
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(folder, tmp, ignore=shutil.ignore_patterns(*[f"*{s}" for s in PICKLE_SUFFIXES]))
    state: dict[str, Any] = {}
    for p in pickles:
        try:
            state.update(torch.load(p, map_location="cpu", weights_only=True))
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise UserError(f"{p}: could not read pickle weights ({exc})") from None
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
    for stale in tmp.glob("*.index.json"):
        stale.unlink()
    os.replace(tmp, target)
    return target
