"""A checkpoint folder's tokenizer: every stage reads it the same way (the quantize job to
tokenize calibration text, export to write the GGUF vocabulary, the runtime to serve)."""

from __future__ import annotations

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
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 - every failure here is a bad tokenizer file, said in one line
        detail = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise UserError(f"{folder}: cannot load the tokenizer ({detail})") from None
