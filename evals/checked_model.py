"""What the gate learns about a model spec before evaluating anything: where it lives, its config
and tokenizer, whether two models tokenize alike, and how long a window it computes exactly. Each
check costs seconds and runs before the minutes of evaluating either model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmfoundry.checkpoint.sources import resolve_model
from lmfoundry.checkpoint.tokenizer import load_tokenizer
from lmfoundry.engine_bundle.engine_manifest import is_engine_bundle, weights_folder
from lmfoundry.errors import UserError
from lmfoundry.model.config import ModelConfig
from lmfoundry.runtime.loader import whole_model_config

# Encoded by both tokenizers of a gate: equal vocabularies can still split text differently
# (merges, normalizer, pre-tokenizer), and then no paired per-document comparison is meaningful.
TOKENIZER_PROBE = ("The quick brown fox jumps over the lazy dog. 1234567890, naïve café — ¿qué? 日本語\n"
                   "\tdef f(x):\n\t\treturn x ** 2  # comment  ")


@dataclass
class CheckedModel:
    """What the up-front check learned about a model spec: where it lives, its config, its tokenizer."""

    spec: str
    folder: Path
    config: ModelConfig
    tokenizer: Any
    bundle: bool = False  # an engine bundle: its compiled kernels run it

    @property
    def context_limit(self) -> int:
        """The longest window the runtime computes exactly for this model (a bundle of a
        sliding-window model: its window; see ModelConfig.kernel_context_limit)."""
        return self.config.kernel_context_limit if self.bundle else self.config.max_position_embeddings


def check_model(spec: str, allow_bundle: bool = False) -> CheckedModel:
    """Resolve `spec` and load its config and tokenizer (not its weights), so that a missing model,
    a folder without a usable config or tokenizer, or one of two mismatched models is reported in
    seconds, before minutes of evaluating the other. With `allow_bundle`, an engine bundle (which
    `load_model` runs) is read from its weights/ folder (rank 0's of a tensor-parallel bundle,
    with the whole model's config)."""
    path = Path(spec).expanduser()
    bundle = allow_bundle and is_engine_bundle(path)
    if bundle:
        folder = weights_folder(path)
        config = whole_model_config(path)
    else:
        folder = resolve_model(spec)
        config = ModelConfig.from_file(folder)
    return CheckedModel(spec, folder, config, load_tokenizer(folder), bundle)


def tokenizer_difference(a: Any, b: Any) -> str | None:
    """None when tokenizers `a` and `b` map text to the same ids (same vocabulary, same special
    token ids, same encoding of a probe text), else what differs."""
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        diff = sorted(set(va.items()) ^ set(vb.items()))
        return f"vocabularies differ: {len(va)} vs {len(vb)} tokens, e.g. {diff[0][0]!r}"
    for attr in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id"):
        if getattr(a, attr, None) != getattr(b, attr, None):
            return f"{attr} {getattr(a, attr, None)} vs {getattr(b, attr, None)}"
    if a(TOKENIZER_PROBE).input_ids != b(TOKENIZER_PROBE).input_ids:
        return "the same text is split into different tokens"
    return None


def check_context(ctx: int, model: CheckedModel, option: str) -> None:
    """Refuse windows longer than the model's position limit: the model never saw such positions
    (the numbers would mean nothing), and on CPU a long window costs minutes before failing."""
    limit = model.context_limit
    if ctx > limit:
        what = ("max_position_embeddings" if limit == model.config.max_position_embeddings
                else "sliding window (the bundle's kernels attend causally over everything)")
        raise UserError(f"{option} {ctx} exceeds {model.spec}'s {what} ({limit}); use {limit} or less")
