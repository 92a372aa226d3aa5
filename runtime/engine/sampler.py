"""Next-token choice per sequence: greedy, or temperature / top-k / top-p sampling, plus logprobs.

Greedy rows use argmax over the raw logits (first index on ties), exactly as transformers' greedy
`generate`. Sampled rows draw from their own `torch.Generator` when the request gave a seed, so a
seeded request gives the same tokens whatever else is in the batch. Reported logprobs are those of
the model's distribution (log-softmax of the raw logits), before temperature and truncation.

Rows are independent requests, so a row that fails (a value that slipped past validation, a NaN
from the model) is reported in `SamplerOutput.errors` instead of raising: the engine fails that
request alone and the rest of the batch keeps its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lmfoundry.runtime.engine.sampling_params import SamplingParams
from lmfoundry.runtime.engine.sequence import Sequence, TokenLogprob

# Smallest temperature used as a divisor: below it float32 rounds the divisor to 0 (0 / 0 = NaN).
MIN_DIVISOR = torch.finfo(torch.float32).tiny


@dataclass
class SamplerOutput:
    tokens: list[int | None]  # None for failed rows
    logprobs: list[TokenLogprob | None]
    errors: dict[int, Exception] = field(default_factory=dict)  # row -> why it failed


def _truncate(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top-k and outside the smallest top-p nucleus."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Draw one token from one row of logits. The row's maximum is subtracted before dividing by
    the temperature, so no finite temperature (1e-42 included) overflows to inf - inf = NaN."""
    scaled = (logits - logits.max()) / max(params.temperature, MIN_DIVISOR)
    probs = _truncate(scaled, params.top_k, params.top_p).softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class Sampler:
    def __init__(self, eos_token_ids: set[int]) -> None:
        self.eos_token_ids = eos_token_ids

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """logits: [len(seqs), vocab] float32. Returns the chosen token and its logprob entry per
        row, and the rows that failed."""
        raw = logits
        out = SamplerOutput([None] * len(seqs), [None] * len(seqs))
        banned = [self._banned(s) for s in seqs]
        if any(banned):
            logits = logits.clone()
            for i, ids in enumerate(banned):
                if ids:
                    try:
                        logits[i, ids] = float("-inf")
                    except Exception as exc:  # noqa: BLE001 - this row's request fails, not the batch
                        out.errors[i] = exc
        greedy = logits.argmax(dim=-1).tolist()
        for i, seq in enumerate(seqs):
            if i in out.errors:
                continue
            try:
                # Greedy rows never leave the device (one argmax for the batch); a random row is
                # drawn on the CPU with its request's generator, so a seed gives the same tokens
                # whatever device computed the logits.
                out.tokens[i] = greedy[i] if seq.params.greedy else sample_row(logits[i].cpu(), seq.params,
                                                                               seq.generator)
            except Exception as exc:  # noqa: BLE001 - this row's request fails, not the batch
                out.errors[i] = exc
        self._logprobs(raw, seqs, out)
        return out

    def _banned(self, seq: Sequence) -> list[int]:
        """EOS and stop tokens are not allowed before min_tokens outputs."""
        if seq.num_output_tokens >= seq.params.min_tokens:
            return []
        return sorted(set(seq.params.stop_token_ids) | self.eos_token_ids)

    @staticmethod
    def _logprobs(raw: torch.Tensor, seqs: list[Sequence], out: SamplerOutput) -> None:
        wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None and i not in out.errors]
        if not wanted:
            return
        logp = torch.log_softmax(raw[wanted], dim=-1)
        k = max(seqs[i].params.logprobs or 0 for i in wanted)
        picked = torch.tensor([out.tokens[i] for i in wanted], device=logp.device)
        chosen = logp.gather(1, picked[:, None])[:, 0].tolist()
        top_v, top_i = logp.topk(k, dim=-1) if k else (None, None)
        for j, i in enumerate(wanted):
            n = seqs[i].params.logprobs or 0
            top = list(zip(top_i[j, :n].tolist(), top_v[j, :n].tolist())) if n else []
            out.logprobs[i] = TokenLogprob(out.tokens[i], chosen[j], top)
