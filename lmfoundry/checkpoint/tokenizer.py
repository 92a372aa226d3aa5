"""A checkpoint folder's tokenizer: every stage reads it the same way (the quantize job to
tokenize calibration text, export to write the GGUF vocabulary, the runtime to serve)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmfoundry.errors import UserError

# Any one of these means the folder carries a tokenizer (checkpoint.folder.TOKENIZER_FILES is the
# longer list of files a written checkpoint copies along with it).
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(folder: str | Path) -> bool:
    return any((Path(folder) / n).is_file() for n in TOKENIZER_MARKERS)


def load_tokenizer(folder: str | Path) -> Any:
    """The folder's tokenizer; missing or unreadable tokenizer files are one UserError line
    (transformers raises anything from OSError to TypeError or a Rust panic's exception)."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not has_tokenizer(folder):
        raise UserError(f"{folder}: no tokenizer files ({', '.join(TOKENIZER_MARKERS)}); copy the tokenizer of the "
                        "model the weights came from into the folder")
    try:
        backend = _generic_backend(folder)
        return backend.from_pretrained(str(folder)) if backend is not None else AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 - every failure here is a bad tokenizer file, said in one line
        detail = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise UserError(f"{folder}: cannot load the tokenizer ({detail})") from None


def _generic_backend(folder: Path) -> Any:
    """transformers' generic `TokenizersBackend` class where the folder names it and AutoTokenizer
    would load that very class, else None (AutoTokenizer decides). AutoTokenizer first builds the
    model's config class to look the tokenizer class up by model type; with torch imported, that
    import chain (the model's configuration module, its activations, transformers' tensor-parallel
    sharding, torch.distributed.tensor, sympy) holds tens of MiB in a serving engine that only needs
    the tokenizer. The cases where AutoTokenizer overrides a named generic class are kept on its
    path: remote code (auto_map), model types transformers marks as carrying a wrong hub class,
    and Mistral's own backend."""
    from transformers.models.auto import tokenization_auto

    try:
        tok_config = json.loads((folder / "tokenizer_config.json").read_text())
        model_config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(tok_config, dict) or not isinstance(model_config, dict):
        return None
    if tok_config.get("tokenizer_class") != "TokenizersBackend" or "auto_map" in tok_config:
        return None
    wrong_class = getattr(tokenization_auto, "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS", None)
    model_type, model_name = model_config.get("model_type"), model_config.get("model_name")
    if not isinstance(model_type, str) or wrong_class is None or model_type in wrong_class \
            or (isinstance(model_name, str) and model_name in wrong_class):
        return None
    registered = tokenization_auto.TOKENIZER_MAPPING_NAMES.get(model_type) or ""
    if registered.startswith("MistralCommon"):
        return None
    return tokenization_auto.tokenizer_class_from_name("TokenizersBackend")
