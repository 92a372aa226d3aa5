"""Next-token distribution statistics of a candidate against its baseline, as llama.cpp's
`llama-perplexity --kl-divergence` reports them: KL(baseline || candidate) per token, same top
token, and Δp (the change in the probability of the token that actually came next).

Why these beside accuracy: accuracy per document is a coin flip with large variance, so a few
hundred documents cannot tell a near-lossless candidate from a 5 % regression. A per-token
divergence has little variance and every token of the held-out text contributes, so a few
thousand tokens decide in minutes what accuracy needs an hour for.

The baseline is evaluated once and its reference kept on disk: for every predicted position, its
`top_k` log-probabilities with their token ids, the log of the probability mass outside them, and
the log-probability of the actual next token. The candidate is then scored against it over its
full vocabulary. The KL divergence is computed between the two distributions coarsened to the
baseline's top-k tokens plus one "rest" bucket. By the log-sum inequality, coarsening never
increases a KL divergence, so the number is a lower bound of the full-vocabulary KL; the gap is
`rest mass x KL between the two renormalized tails`, zero when `top_k` covers the vocabulary.
The report states the baseline's mean rest mass, so a reader sees how much was coarsened.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

DEFAULT_TOP_K = 128


def _log_rest(logprobs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log of the probability mass outside `ids`, summed over the remaining tokens (not as
    1 - sum(top-k), which cancels catastrophically when the top-k hold almost everything)."""
    masked = logprobs.scatter(-1, ids, float("-inf"))
    return torch.logsumexp(masked, dim=-1)


ROWS_AT_ONCE = 128  # positions whose full-vocabulary temporaries exist at once


def _by_rows(fn: Callable[..., tuple[np.ndarray, ...]], logits: torch.Tensor, targets: torch.Tensor,
             rows: int = ROWS_AT_ONCE) -> tuple[np.ndarray, ...]:
    """`fn` over `logits` [B, T, V] `rows` positions at a time, its [B, t, ...] results joined
    along positions. Each call makes a few full-vocabulary float copies (log-softmax, the masked
    rest, comparisons): over a whole batch of windows of a 128k-152k vocabulary those were GBs,
    more than the model's own activations; `rows` positions at a time they are a few hundred MB.
    `fn` gets the positions' logits, targets and slice."""
    parts = []
    for lo in range(0, logits.shape[1], rows):
        at = slice(lo, min(lo + rows, logits.shape[1]))
        parts.append(fn(logits[:, at], targets[:, at], at))
    return tuple(np.concatenate(p, axis=1) for p in zip(*parts, strict=True))


@dataclass
class Reference:
    """The baseline's next-token distributions on the perplexity windows ([windows, positions])."""

    ids: np.ndarray  # [W, T, k] int32, by descending probability
    logprobs: np.ndarray  # [W, T, k] float32
    log_rest: np.ndarray  # [W, T] float32: log of the mass outside the top-k (-inf when none)
    target_logprob: np.ndarray  # [W, T] float32: log p(actual next token)

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[-1])

    def save(self, path: Path) -> None:
        """Written to a temporary name and renamed: a killed run leaves no half reference."""
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(tmp, ids=self.ids, logprobs=self.logprobs, log_rest=self.log_rest,
                            target_logprob=self.target_logprob)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Reference:
        with np.load(path) as data:
            return cls(data["ids"], data["logprobs"], data["log_rest"], data["target_logprob"])

    def digest(self) -> str:
        h = hashlib.sha256()
        for a in (self.ids, self.logprobs, self.log_rest, self.target_logprob):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()


class ReferenceRecorder:
    """Collects a `Reference` from the baseline's logits, one batch of windows at a time."""

    def __init__(self, top_k: int = DEFAULT_TOP_K) -> None:
        self.top_k = top_k
        self._parts: list[tuple[np.ndarray, ...]] = []

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """`logits` [B, T, V] predict `targets` [B, T]."""
        self._parts.append(_by_rows(self._record, logits, targets))

    def _record(self, logits: torch.Tensor, targets: torch.Tensor, _at: slice) -> tuple[np.ndarray, ...]:
        lp = torch.log_softmax(logits.float(), dim=-1)
        k = min(self.top_k, lp.shape[-1])
        top, ids = lp.topk(k, dim=-1)
        rest = _log_rest(lp, ids)
        target = lp.gather(-1, targets.unsqueeze(-1).to(lp.device)).squeeze(-1)
        return tuple(t.cpu().numpy() for t in (ids.to(torch.int32), top, rest, target))

    def reference(self) -> Reference:
        ids, lps, rest, target = (np.concatenate(p) for p in zip(*self._parts, strict=True))
        return Reference(ids, lps, rest, target)


@dataclass
class TokenStatistics:
    """Per-token statistics of a candidate against a reference, [windows, positions] each."""

    kld: np.ndarray  # float64, >= 0
    same_top: np.ndarray  # bool: the candidate's most likely token is (one of) the baseline's
    delta_p: np.ndarray  # float64: p_candidate(next) - p_baseline(next)
    rest_mass: np.ndarray  # float64: the baseline's mass outside its top-k (the coarsening)

    def to_lists(self) -> dict[str, list[list[float]]]:
        """JSON form (floats round-trip exactly through Python's JSON)."""
        return {"kld": self.kld.tolist(), "same_top": self.same_top.astype(float).tolist(),
                "delta_p": self.delta_p.tolist(), "rest_mass": self.rest_mass.tolist()}

    @classmethod
    def from_lists(cls, data: dict[str, list[list[float]]]) -> TokenStatistics:
        return cls(np.asarray(data["kld"], dtype=np.float64), np.asarray(data["same_top"]) > 0.5,
                   np.asarray(data["delta_p"], dtype=np.float64), np.asarray(data["rest_mass"], dtype=np.float64))


class DivergenceScorer:
    """Scores a candidate's logits against a baseline `Reference`, batch by batch, in window order."""

    def __init__(self, reference: Reference) -> None:
        self.reference = reference
        self._next = 0
        self._rows = slice(0, 0)  # the windows of the batch being scored
        self._parts: list[tuple[np.ndarray, ...]] = []

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        ref = self.reference
        rows = slice(self._next, self._next + logits.shape[0])
        self._next += logits.shape[0]
        if ref.ids[rows].shape[:2] != tuple(logits.shape[:2]):
            raise ValueError("the candidate's perplexity windows differ from the baseline's reference")
        self._rows = rows
        self._parts.append(_by_rows(self._score, logits, targets))

    def _score(self, logits: torch.Tensor, targets: torch.Tensor, at: slice) -> tuple[np.ndarray, ...]:
        ref, rows = self.reference, self._rows
        lp = torch.log_softmax(logits.float(), dim=-1)  # on the model's device (a GPU for a bundle)
        ids = torch.from_numpy(np.ascontiguousarray(ref.ids[rows, at])).long().to(lp.device)
        cand_k = lp.gather(-1, ids).double()
        cand_rest = _log_rest(lp, ids).double()
        base_k = torch.from_numpy(np.array(ref.logprobs[rows, at])).double().to(lp.device)
        base_rest = torch.from_numpy(np.array(ref.log_rest[rows, at])).double().to(lp.device)
        kld = (base_k.exp() * (base_k - cand_k)).sum(-1)
        rest = base_rest.exp()
        # the rest bucket's term; zero when the baseline's top-k covered everything
        kld = kld + torch.where(rest > 0, rest * (base_rest - cand_rest), torch.zeros_like(rest))
        # the same top token, ties counted as agreement both ways (bf16 logits tie often, and
        # which of two equal maxima argmax or topk returns is arbitrary)
        cand_max = lp.max(-1).values
        base_at_cand_top = torch.where(ids == lp.argmax(-1, keepdim=True), base_k, float("-inf")).max(-1).values
        same = (lp.gather(-1, ids[..., :1]).squeeze(-1) == cand_max) | (base_at_cand_top == base_k[..., 0])
        cand_target = lp.gather(-1, targets.unsqueeze(-1).to(lp.device)).squeeze(-1).double()
        dp = cand_target.exp() - torch.from_numpy(np.array(ref.target_logprob[rows, at])).double().to(lp.device).exp()
        # rounding can leave a tiny negative KL for identical distributions; KL is >= 0
        return tuple(t.cpu().numpy() for t in (kld.clamp_min(0), same, dp, rest))

    def statistics(self) -> TokenStatistics:
        if self._next != self.reference.ids.shape[0]:
            raise ValueError(f"scored {self._next} windows of the reference's {self.reference.ids.shape[0]}")
        kld, same, dp, rest = (np.concatenate(p) for p in zip(*self._parts, strict=True))
        return TokenStatistics(kld, same, dp, rest)


def summary(tokens: TokenStatistics) -> dict[str, float]:
    """llama.cpp's table: KLD mean/median/p99/max, same-top rate, RMS Δp, and the coarsening."""
    kld = tokens.kld.ravel()
    return {
        "tokens": int(kld.size),
        "mean_kld": float(kld.mean()), "median_kld": float(np.median(kld)),
        "p99_kld": float(np.quantile(kld, 0.99)), "max_kld": float(kld.max()),
        "same_top": float(tokens.same_top.mean()),
        "rms_delta_p": float(np.sqrt(np.mean(tokens.delta_p ** 2))),
        "mean_delta_p": float(tokens.delta_p.mean()),
        "mean_rest_mass": float(tokens.rest_mass.mean()),
    }
