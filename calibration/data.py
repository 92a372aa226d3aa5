"""Calibration and evaluation text: load, tokenize, sample deterministically, hash.

Sources: a plain text file, a JSONL file (`text` field, or chat `messages` rendered with the
tokenizer's chat template), a `datasets` folder saved with `save_to_disk`, or a built-in name
(`c4`, `wiki`, ... from the exllamav2 calibration set). The exact token ids used are hashed so a
manifest pins the data, not just its file name.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmfoundry.errors import UserError
from lmfoundry.resources import CALIBRATION_TEXTS, calibration_text

DEFAULT_CALIB = "c4"
DEFAULT_EVAL_TEXT = "wiki"
# The perplexity text is the tail of wiki.utf8 (never used for calibration): the last fraction.
EVAL_TAIL_FRACTION = 0.25


@dataclass
class CalibrationSet:
    token_ids: torch.Tensor  # [num_samples, seq_len] int64
    source: str
    source_sha256: str
    seed: int

    @property
    def token_sha256(self) -> str:
        return token_hash(self.token_ids)

    def describe(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "source_sha256": self.source_sha256,
            "num_samples": int(self.token_ids.shape[0]),
            "seq_len": int(self.token_ids.shape[1]),
            "seed": self.seed,
            "token_ids_sha256": self.token_sha256,
        }


def token_hash(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def resolve_text_source(spec: str | None, default: str = DEFAULT_CALIB) -> Path:
    spec = spec or default
    if spec in CALIBRATION_TEXTS:
        return calibration_text(spec)
    path = Path(spec).expanduser()
    if not path.exists():
        raise UserError(f"{spec}: no such calibration file or folder (built-in: {', '.join(CALIBRATION_TEXTS)})")
    return path


def load_documents(spec: str | None, tokenizer: Any, default: str = DEFAULT_CALIB) -> tuple[list[str], Path, str]:
    """Documents from a source, plus its path and a sha256 of its bytes."""
    path = resolve_text_source(spec, default)
    if path.is_dir():
        docs = _datasets_docs(path, tokenizer)
        digest = _dir_hash(path)
    else:
        raw = path.read_bytes()
        digest = hashlib.sha256(raw).hexdigest()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{path}: not UTF-8 text") from None
        if path.suffix in (".jsonl", ".json"):
            docs = _jsonl_docs(path, text, tokenizer)
        else:
            docs = [text]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise UserError(f"{path}: calibration source is empty")
    return docs, path, digest


def _render(record: dict[str, Any], tokenizer: Any, where: str) -> str:
    if isinstance(record.get("text"), str):
        return record["text"]
    if isinstance(record.get("messages"), list):
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"{where}: `messages` records need a tokenizer with a chat template")
        return tokenizer.apply_chat_template(record["messages"], tokenize=False)
    raise UserError(f"{where}: each record needs a `text` string or a `messages` list")


def _jsonl_docs(path: Path, text: str, tokenizer: Any) -> list[str]:
    docs = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{i}: invalid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise UserError(f"{path}:{i}: expected a JSON object")
        docs.append(_render(record, tokenizer, f"{path}:{i}"))
    return docs


def _datasets_docs(path: Path, tokenizer: Any) -> list[str]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise UserError(f"{path}: not a dataset saved with save_to_disk ({exc})") from None
    if isinstance(ds, datasets.DatasetDict):
        split = "train" if "train" in ds else next(iter(ds))
        ds = ds[split]
    return [_render(r, tokenizer, str(path)) for r in ds]


def _dir_hash(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def tokenize_stream(docs: list[str], tokenizer: Any) -> torch.Tensor:
    """Concatenate documents into one token stream, each document starting with BOS if the
    tokenizer has one (as the model saw text in pre-training)."""
    bos = tokenizer.bos_token_id
    ids: list[int] = []
    for d in docs:
        if bos is not None:
            ids.append(bos)
        ids.extend(tokenizer(d, add_special_tokens=False)["input_ids"])
    return torch.tensor(ids, dtype=torch.int64)


def load_calibration(
    spec: str | None, tokenizer: Any, num_samples: int, seq_len: int, seed: int
) -> CalibrationSet:
    """`num_samples` windows of `seq_len` tokens at seeded random offsets of the token stream."""
    if num_samples <= 0 or seq_len <= 0:
        raise UserError("--num-samples and --seq-len must be positive")
    docs, path, digest = load_documents(spec, tokenizer)
    stream = tokenize_stream(docs, tokenizer)
    if stream.numel() < seq_len + 1:
        raise UserError(f"{path}: only {stream.numel()} tokens, fewer than --seq-len {seq_len}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - seq_len + 1, (num_samples,), generator=gen)
    windows = torch.stack([stream[s : s + seq_len] for s in starts.tolist()])
    return CalibrationSet(windows, str(path), digest, seed)


def eval_token_stream(spec: str | None, tokenizer: Any) -> tuple[torch.Tensor, str, str]:
    """Token stream for perplexity. Default: the tail of wiki.utf8 (held out from calibration)."""
    if spec is None:
        path = calibration_text(DEFAULT_EVAL_TEXT)
        raw = path.read_bytes()
        text = raw.decode("utf-8")
        tail = text[int(len(text) * (1 - EVAL_TAIL_FRACTION)) :]
        tail = tail[tail.find("\n") + 1 :]  # start at a line boundary
        return tokenize_stream([tail], tokenizer), f"{path} (last {EVAL_TAIL_FRACTION:.0%})", hashlib.sha256(raw).hexdigest()
    docs, path, digest = load_documents(spec, tokenizer)
    return tokenize_stream(docs, tokenizer), str(path), digest
