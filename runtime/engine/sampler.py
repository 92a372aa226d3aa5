"""Next-token choice per sequence: greedy, or temperature / top-k / top-p sampling, plus logprobs.

Greedy rows use argmax over the raw logits (first index on ties), exactly as transformers' greedy
`generate`. Sampled rows draw from their own `torch.Generator` when the request gave a seed, so a
seeded request gives the same tokens whatever else is in the batch. Reported logprobs are those of
the model's distribution (log-softmax of the raw logits), before temperature and truncation.
"""

from __future__ import annotations

import torch

from lmfoundry.runtime.engine.sequence import Sequence, TokenLogprob


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


class Sampler:
    def __init__(self, eos_token_ids: set[int]) -> None:
        self.eos_token_ids = eos_token_ids

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [len(seqs), vocab] float32. Returns the chosen token and its logprob entry per row."""
        raw = logits
        banned = [self._banned(s) for s in seqs]
        if any(banned):
            logits = logits.clone()
            for i, ids in enumerate(banned):
                if ids:
                    logits[i, ids] = float("-inf")
        greedy = logits.argmax(dim=-1).tolist()
        tokens: list[int] = []
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.greedy:
                tokens.append(greedy[i])
                continue
            row = _truncate(logits[i] / p.temperature, p.top_k, p.top_p)
            probs = row.softmax(-1)
            tokens.append(int(torch.multinomial(probs, 1, generator=seq.generator)))
        return tokens, self._logprobs(raw, seqs, tokens)

    def _banned(self, seq: Sequence) -> list[int]:
        """EOS and stop tokens are not allowed before min_tokens outputs."""
        if seq.num_output_tokens >= seq.params.min_tokens:
            return []
        return sorted(set(seq.params.stop_token_ids) | self.eos_token_ids)

    @staticmethod
    def _logprobs(raw: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[TokenLogprob | None]:
        wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        out: list[TokenLogprob | None] = [None] * len(seqs)
        if not wanted:
            return out
        logp = torch.log_softmax(raw[wanted], dim=-1)
        k = max(seqs[i].params.logprobs or 0 for i in wanted)
        chosen = logp.gather(1, torch.tensor([tokens[i] for i in wanted])[:, None])[:, 0].tolist()
        top_v, top_i = logp.topk(k, dim=-1) if k else (None, None)
        for j, i in enumerate(wanted):
            n = seqs[i].params.logprobs or 0
            top = list(zip(top_i[j, :n].tolist(), top_v[j, :n].tolist())) if n else []
            out[i] = TokenLogprob(tokens[i], chosen[j], top)
        return out
