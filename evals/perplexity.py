"""Perplexity over non-overlapping windows, token-weighted, on the reference execution path or
the serving engine.

The text is tokenized as one stream (BOS before each document) and cut into windows of `ctx`
tokens; every window predicts its `ctx - 1` next tokens with no context carried over. Per-window
NLL sums are returned for paired statistics (eval-gate); `observe` sees each batch's logits and
next tokens (eval-gate's divergence statistics). The model is a forward (`CausalLM` or any
callable: ids [B, T] -> logits [B, T, V]) or an object with `next_token_logits` (ids [B, T] ->
logits [B, T - 1, V]: `RuntimeLM` on the serving engine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from lmfoundry.errors import UserError
from lmfoundry.model.reference import CausalLM


@dataclass
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per predicted token (nats)
    tokens: int  # predicted tokens
    windows: int
    ctx: int
    window_nll: list[float] = field(default_factory=list)  # summed NLL per window

    def to_dict(self) -> dict:
        return {"ppl": self.ppl, "nll": self.nll, "tokens": self.tokens, "windows": self.windows, "ctx": self.ctx}


def windows_of(stream: torch.Tensor, ctx: int, max_windows: int | None = None) -> torch.Tensor:
    if ctx < 2:
        raise UserError("--ctx must be at least 2")
    n = stream.numel() // ctx
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise UserError(f"text has {stream.numel()} tokens, fewer than one window of --ctx {ctx}")
    return stream[: n * ctx].view(n, ctx)


ROWS_AT_ONCE = 128  # positions whose full-vocabulary temporaries (log-softmax, masks) exist at once


def summed_nll(logits: torch.Tensor, targets: torch.Tensor, rows: int = ROWS_AT_ONCE) -> torch.Tensor:
    """Summed NLL per row of `logits` [B, T, V] predicting `targets` [B, T], `rows` positions at a
    time: cross_entropy over all of [B, T, V] at once makes a log-softmax copy as large as the
    logits, which for a 128k-152k vocabulary is a third of a GB per 512-token window."""
    out = torch.zeros(logits.shape[0], dtype=torch.float64)
    for lo in range(0, logits.shape[1], rows):
        part = logits[:, lo : lo + rows]
        nll = F.cross_entropy(part.reshape(-1, part.shape[-1]), targets[:, lo : lo + rows].reshape(-1).to(part.device),
                              reduction="none").view(part.shape[0], -1)
        out += nll.double().sum(1).cpu()
    return out


@torch.no_grad()
def perplexity(
    model: CausalLM | Callable[[torch.Tensor], torch.Tensor] | Any, stream: torch.Tensor, ctx: int = 512,
    max_windows: int | None = None, batch_size: int = 4, progress: bool = True,
    observe: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> PerplexityResult:
    if batch_size < 1:  # torch's split(0) would raise deep inside; say which option is wrong
        raise UserError(f"--batch-size must be at least 1, got {batch_size}")
    wins = windows_of(stream, ctx, max_windows)
    sums: list[float] = []
    scorer = getattr(model, "next_token_logits", None)
    for batch in tqdm(wins.split(batch_size), desc="perplexity", unit="batch", disable=not progress):
        logits = scorer(batch) if scorer is not None else model(batch)[:, :-1]
        if observe is not None:
            observe(logits, batch[:, 1:])
        sums.extend(summed_nll(logits, batch[:, 1:]).tolist())
        del logits  # before the next batch's logits exist
    tokens = wins.shape[0] * (ctx - 1)
    mean = sum(sums) / tokens
    return PerplexityResult(math.exp(mean), mean, tokens, wins.shape[0], ctx, sums)
