"""Next-token choice per sequence: logits processing, then a greedy or sampled choice, plus logprobs.

One call handles the rows of one step (one row per sequence that gets a token), every stage
batched over the rows with per-row parameters; no stage loops over the vocabulary in Python:

1. `process_logits`: `logit_bias` is added; `repetition_penalty` rescales the logits of tokens
   seen in the prompt or the output; `frequency_penalty` / `presence_penalty` subtract the
   count-based terms over the output; EOS and stop tokens are banned (-inf) before `min_tokens`.
   Token counts come from one scatter over the penalized rows' token ids. Last, rows with an
   output grammar (structured output, `grammar.py`) get -inf wherever their grammar forbids the
   token: the grammar rows' bitmasks are computed together on the CPU, unpacked on the logits'
   device and applied with one masked fill over those rows only. Rows that ask for none of this
   are left as they are, and nothing is copied when no row asks.
2. Greedy rows (temperature 0 or top_k 1) take one batched argmax of the processed logits (first
   index on ties, as transformers' greedy `generate`), so penalties and biases change greedy
   choices too.
3. Sampled rows go to the CPU, where `sampling_probs` turns them into distributions in one batched
   pass (temperature, top-k, top-p, min-p), and each row is drawn (`sample_row`) with its own
   `torch.Generator` when the request gave a seed: a seeded request gives the same tokens whatever
   else is in the batch and whatever device computed the logits.
4. Grammar rows advance their matcher with the chosen token, so the next step's mask follows the
   output; a token the grammar rejects (never, short of a bug) fails that row.

Reported logprobs are those of the model's distribution (log-softmax of the raw logits), before
processing, temperature and truncation (vLLM's default "raw" logprobs): scores stay comparable
between requests with different sampling settings.

`reference_process_row`, `reference_grammar_row` and `reference_probs` state the same semantics
plainly, one row and one token at a time; the tests hold the batched code to them.

Rows are independent requests, so a row that fails (a value that slipped past validation, a NaN
from the model, a logit_bias id outside the vocabulary) is reported in `SamplerOutput.errors`
instead of raising: the engine fails that request alone and the rest of the batch keeps its tokens.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

import torch

from lmfoundry.runtime.engine.grammar import GrammarMatcher, advance, bitmask_to_allowed, fill_bitmasks
from lmfoundry.runtime.engine.outputs import TokenLogprob
from lmfoundry.runtime.engine.sampling_params import SamplingParams
from lmfoundry.runtime.engine.sequence import Sequence

# Smallest temperature used as a divisor: below it float32 rounds the divisor to 0 (0 / 0 = NaN).
MIN_DIVISOR = torch.finfo(torch.float32).tiny


@dataclass
class SamplerOutput:
    tokens: list[int | None]  # None for failed rows
    logprobs: list[TokenLogprob | None]
    errors: dict[int, Exception] = field(default_factory=dict)  # row -> why it failed


def banned_tokens(seq: Sequence, eos_token_ids: set[int]) -> list[int]:
    """EOS and stop tokens are not allowed before min_tokens outputs."""
    if seq.num_output_tokens >= seq.params.min_tokens:
        return []
    return sorted(set(seq.params.stop_token_ids) | eos_token_ids)


def _out_of_vocab(ids: Iterable[int], vocab: int) -> int | None:
    return next((t for t in ids if not 0 <= t < vocab), None)


def _padded_ids(seqs: list[Sequence], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, longest] int64 token ids (prompt then output) padded with `pad`, and each row's
    prompt length."""
    ids = torch.full((len(seqs), max(len(s) for s in seqs)), pad, dtype=torch.int64)
    for r, seq in enumerate(seqs):
        ids[r, : len(seq)] = seq.token_id_tensor()
    return ids, torch.tensor([s.num_prompt_tokens for s in seqs], dtype=torch.int64)


def _apply_penalties(x: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition, frequency and presence penalties of `seqs` applied to their rows `x` [P, V]."""
    rows, vocab = x.shape
    ids, prompt_lens = _padded_ids(seqs, vocab)  # the padding id `vocab` lands in a dropped column
    ids = ids.to(x.device)
    seen = torch.zeros((rows, vocab + 1), dtype=torch.bool, device=x.device).scatter_(1, ids, True)[:, :vocab]
    is_output = torch.arange(ids.shape[1], device=x.device)[None, :] >= prompt_lens.to(x.device)[:, None]
    counts = torch.zeros((rows, vocab + 1), dtype=x.dtype, device=x.device)
    counts.scatter_add_(1, torch.where(is_output, ids, vocab), torch.ones_like(ids, dtype=x.dtype))
    counts = counts[:, :vocab]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=x.dtype, device=x.device)[:, None]

    rep = column([s.params.repetition_penalty for s in seqs])
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    freq = column([s.params.frequency_penalty for s in seqs])
    pres = column([s.params.presence_penalty for s in seqs])
    return x - (counts * freq + (counts > 0).to(x.dtype) * pres)


def process_logits(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int],
                   errors: dict[int, Exception]) -> torch.Tensor:
    """The logits every choice is made from: logit_bias, then repetition/frequency/presence
    penalties, then the min_tokens bans, then the grammar masks, each applied to all the rows
    that ask for it at once.
    Returns `logits` itself when no row asks for anything. A row whose token ids fall outside the
    vocabulary is recorded in `errors` and left out (its request fails, the batch does not)."""
    vocab = logits.shape[-1]
    device = logits.device
    out = logits

    def writable() -> torch.Tensor:
        nonlocal out
        if out is logits:
            out = logits.clone()
        return out

    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, seq in enumerate(seqs):
        bias = seq.params.logit_bias
        if not bias or i in errors:
            continue
        if (bad := _out_of_vocab(bias, vocab)) is not None:
            errors[i] = ValueError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab})")
            continue
        rows.extend([i] * len(bias))
        cols.extend(bias)
        values.extend(float(v) for v in bias.values())
    if rows:
        x = writable()
        r, c = torch.tensor(rows, device=device), torch.tensor(cols, device=device)
        x[r, c] = x[r, c] + torch.tensor(values, dtype=x.dtype, device=device)  # (row, id) pairs are unique

    penalized = [i for i, seq in enumerate(seqs) if seq.params.penalized and i not in errors]
    for i in list(penalized):
        seen = seqs[i].token_id_tensor()
        if int(seen.min()) < 0 or int(seen.max()) >= vocab:  # the engine checks prompts; a guard
            errors[i] = ValueError(f"a token id of the sequence is outside the vocabulary [0, {vocab})")
            penalized.remove(i)
    if penalized:
        x = writable()
        index = torch.tensor(penalized, device=device)
        x.index_copy_(0, index, _apply_penalties(x.index_select(0, index), [seqs[i] for i in penalized]))

    rows, cols = [], []
    for i, seq in enumerate(seqs):
        if i in errors or not (ids := banned_tokens(seq, eos_token_ids)):
            continue
        if (bad := _out_of_vocab(ids, vocab)) is not None:
            errors[i] = ValueError(f"stop token id {bad} is outside the vocabulary [0, {vocab})")
            continue
        rows.extend([i] * len(ids))
        cols.extend(ids)
    if rows:
        writable()[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")

    constrained = [(i, seq.grammar) for i, seq in enumerate(seqs) if seq.grammar is not None and i not in errors]
    if constrained:
        apply_grammar_masks(writable(), [i for i, _ in constrained], [g for _, g in constrained], errors)
    return out


def apply_grammar_masks(x: torch.Tensor, rows: list[int], matchers: list[GrammarMatcher],
                        errors: dict[int, Exception]) -> None:
    """Set, in place, the logits of rows `rows` of `x` to -inf at every token their matcher does
    not allow next. The masks are computed together on the CPU (`fill_bitmasks`) and unpacked on
    x's device; rows without a grammar are not touched and cost nothing. A row whose matcher is in
    an error state, or that has no token left (the grammar's tokens all banned by min_tokens or
    stop_token_ids), is recorded in `errors`: sampling it would produce a token the grammar
    rejects."""
    live: list[tuple[int, GrammarMatcher]] = []
    for i, matcher in zip(rows, matchers, strict=True):
        if (why := matcher.error) is not None:
            errors[i] = ValueError(f"the output grammar failed: {why}")
        else:
            live.append((i, matcher))
    if not live:
        return
    allowed = bitmask_to_allowed(fill_bitmasks([m for _, m in live]), x.shape[-1], x.device)
    index = torch.tensor([i for i, _ in live], device=x.device)
    masked = x.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    x.index_copy_(0, index, masked)
    for (i, _), stuck in zip(live, torch.isneginf(masked).all(dim=-1).tolist(), strict=True):
        if stuck:
            errors[i] = ValueError("no token is allowed by both the output grammar and the bans of "
                                   "min_tokens / stop_token_ids")


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Distributions [rows, V] to draw from: temperature, then top-k (ties with the k-th logit
    kept), top-p (a token is dropped when the mass before it already reaches top_p; the first
    always stays) and min-p (dropped below min_p times the top token's probability), each row with
    its own settings, over one descending sort per row. The row's maximum is subtracted before
    dividing by the temperature, so no finite temperature (1e-42 included) makes inf - inf = NaN;
    a NaN temperature or logit gives a NaN row, which fails in `sample_row` alone."""
    vocab = logits.shape[-1]
    dtype = logits.dtype

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=logits.device)[:, None]

    temperature = column([p.temperature for p in params]).clamp_min(MIN_DIVISOR)
    scaled = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    x, order = scaled.sort(dim=-1, descending=True)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab:
        kth = x.gather(1, torch.tensor(top_k, device=logits.device)[:, None] - 1)
        x = x.masked_fill(x < kth, float("-inf"))
    top_p = column([p.top_p for p in params])
    if bool((top_p < 1).any()):
        probs = x.softmax(-1)
        x = x.masked_fill((probs.cumsum(-1) - probs >= top_p) & (top_p < 1), float("-inf"))
    min_p = column([p.min_p for p in params])
    if bool((min_p > 0).any()):
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p * probs[:, :1], float("-inf"))
    return torch.zeros_like(x).scatter_(1, order, x.softmax(-1))


def sample_row(probs: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Draw one request's token from its distribution (a row of `sampling_probs`) with the
    request's generator. The one per-row step of sampling: it is where a bad row (NaN) fails
    alone, and where a test can make one request's row fail (it receives the request's params)."""
    return int(torch.multinomial(probs, 1, generator=generator))


class Sampler:
    def __init__(self, eos_token_ids: set[int]) -> None:
        self.eos_token_ids = eos_token_ids

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """logits: [len(seqs), vocab] float32. Returns the chosen token and its logprob entry per
        row, and the rows that failed."""
        out = SamplerOutput([None] * len(seqs), [None] * len(seqs))
        processed = process_logits(logits, seqs, self.eos_token_ids, out.errors)
        # Greedy rows never leave the device (one argmax for the batch).
        greedy = processed.argmax(dim=-1).tolist()
        sampled = []
        for i, seq in enumerate(seqs):
            if i in out.errors:
                continue
            if seq.params.greedy:
                out.tokens[i] = greedy[i]
            else:
                sampled.append(i)
        if sampled:
            try:
                probs = sampling_probs(processed[sampled].cpu(), [seqs[i].params for i in sampled])
            except Exception as exc:  # noqa: BLE001 - these rows' requests fail, not the batch
                out.errors.update((i, exc) for i in sampled)
                sampled = []
            for j, i in enumerate(sampled):
                try:
                    out.tokens[i] = sample_row(probs[j], seqs[i].params, seqs[i].generator)
                except Exception as exc:  # noqa: BLE001 - this row's request fails, not the batch
                    out.errors[i] = exc
        self._advance_grammars(seqs, out)
        self._logprobs(logits, seqs, out)
        return out

    @staticmethod
    def _advance_grammars(seqs: list[Sequence], out: SamplerOutput) -> None:
        """Feed each grammar row's chosen token to its matcher (all rows at once)."""
        rows: list[int] = []
        matchers: list[GrammarMatcher] = []
        tokens: list[int] = []
        for i, seq in enumerate(seqs):
            token = out.tokens[i]
            if seq.grammar is not None and i not in out.errors and token is not None:
                rows.append(i)
                matchers.append(seq.grammar)
                tokens.append(token)
        if not rows:
            return
        for i, matcher, token, accepted in zip(rows, matchers, tokens, advance(matchers, tokens), strict=True):
            if not accepted:
                out.errors[i] = ValueError(f"the output grammar rejected token {token}: {matcher.error}")
                out.tokens[i] = None

    @staticmethod
    def _logprobs(raw: torch.Tensor, seqs: list[Sequence], out: SamplerOutput) -> None:
        wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None and i not in out.errors]
        if not wanted:
            return
        logp = torch.log_softmax(raw[wanted], dim=-1)
        k = max(seqs[i].params.logprobs or 0 for i in wanted)
        tokens = [t for t in (out.tokens[i] for i in wanted) if t is not None]  # rows without errors have one
        picked = torch.tensor(tokens, device=logp.device)
        chosen = logp.gather(1, picked[:, None])[:, 0].tolist()
        best = logp.topk(k, dim=-1)  # k = 0: empty rows
        top_i, top_v = best.indices.tolist(), best.values.tolist()
        for j, i in enumerate(wanted):
            n = seqs[i].params.logprobs or 0
            out.logprobs[i] = TokenLogprob(tokens[j], chosen[j], list(zip(top_i[j][:n], top_v[j][:n], strict=True)))


# ---- the plain statement of the same semantics (tests check the batched code against it) ----
def reference_process_row(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                          output_ids: list[int], banned: Iterable[int] = ()) -> torch.Tensor:
    """One row's processed logits in float64, token by token: logit_bias added; repetition
    penalty (HF/vLLM) on every token of prompt or output: divide a positive logit, multiply a
    negative one; frequency and presence penalties (OpenAI) over the output's token counts;
    banned tokens set to -inf."""
    row = [float(v) for v in logits.tolist()]
    for token, bias in params.logit_bias.items():
        row[token] += bias
    rep = params.repetition_penalty
    for token in set(prompt_ids) | set(output_ids):
        row[token] = row[token] / rep if row[token] > 0 else row[token] * rep
    for token, count in Counter(output_ids).items():
        row[token] -= count * params.frequency_penalty + params.presence_penalty
    for token in banned:
        row[token] = -math.inf
    return torch.tensor(row, dtype=torch.float64)


def reference_grammar_row(logits: torch.Tensor, matcher: GrammarMatcher) -> torch.Tensor:
    """One row with its grammar applied, token by token: each token's logit is kept when the
    matcher says it may come next (`GrammarMatcher.allows`, llguidance's token validation, not the
    bitmask) and is -inf otherwise."""
    row = [float(v) for v in logits.tolist()]
    return torch.tensor([v if matcher.allows(t) else -math.inf for t, v in enumerate(row)], dtype=torch.float64)


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's sampling distribution in float64, token by token (see `sampling_probs`); a
    greedy request puts all the mass on the first maximal token."""
    row = [float(v) for v in logits.tolist()]
    vocab = len(row)
    if params.greedy:
        best = max(range(vocab), key=lambda t: (row[t], -t))
        return torch.tensor([1.0 if t == best else 0.0 for t in range(vocab)], dtype=torch.float64)
    top = max(row)
    temperature = max(params.temperature, float(MIN_DIVISOR))
    x = [(v - top) / temperature for v in row]
    order = sorted(range(vocab), key=lambda t: -x[t])
    keep = [v > -math.inf for v in x]

    def normalized() -> list[float]:
        weights = [math.exp(x[t]) if keep[t] else 0.0 for t in range(vocab)]
        total = sum(weights)
        return [w / total for w in weights]

    if 0 < params.top_k < vocab:
        kth = x[order[params.top_k - 1]]
        keep = [k and v >= kth for k, v in zip(keep, x, strict=True)]
    if params.top_p < 1:
        p = normalized()
        before = 0.0
        for t in order:
            if before >= params.top_p:
                keep[t] = False
            before += p[t]
    if params.min_p > 0:
        p = normalized()
        threshold = params.min_p * max(p)
        keep = [k and pt >= threshold for k, pt in zip(keep, p, strict=True)]
    return torch.tensor(normalized(), dtype=torch.float64)
