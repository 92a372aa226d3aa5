"""The batched sampler against its plain per-row reference (`reference_process_row`,
`reference_probs`) on random logits, with per-row settings mixed in one batch."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import reference_greedy
from toy import toy_model

from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from lmfoundry.runtime.engine.sampler import (
    Sampler,
    banned_tokens,
    process_logits,
    reference_probs,
    reference_process_row,
    sampling_probs,
)
from lmfoundry.runtime.engine.sequence import Sequence

VOCAB = 300
EOS = {7}


def make_seq(rng: random.Random, params: SamplingParams, prompt_len: int | None = None,
             out_len: int | None = None) -> Sequence:
    """A sequence with a random prompt and random generated tokens drawn from a small id range,
    so that tokens repeat (counts above 1, prompt and output overlapping)."""
    prompt = [rng.randrange(40) for _ in range(prompt_len if prompt_len is not None else rng.randint(1, 30))]
    seq = Sequence("r", 0, prompt, params)
    seq.token_ids.extend(rng.randrange(60) for _ in range(out_len if out_len is not None else rng.randint(0, 25)))
    return seq


def random_params(rng: random.Random) -> SamplingParams:
    """Each feature on or off at random, with values across their ranges."""
    def maybe(value, off):
        return value if rng.random() < 0.6 else off

    return SamplingParams(
        max_tokens=64,
        temperature=maybe(rng.choice([0.0, 0.3, 1.0, 1.7]), 1.0),
        top_k=maybe(rng.choice([1, 5, 40]), 0),
        top_p=maybe(rng.choice([0.3, 0.8, 0.95]), 1.0),
        min_p=maybe(rng.choice([0.02, 0.1, 0.5]), 0.0),
        repetition_penalty=maybe(rng.choice([0.7, 1.3, 2.0]), 1.0),
        frequency_penalty=maybe(rng.uniform(-2, 2), 0.0),
        presence_penalty=maybe(rng.uniform(-2, 2), 0.0),
        logit_bias=maybe({rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randint(1, 6))}, {}),
        min_tokens=maybe(rng.randint(0, 40), 0),
        stop_token_ids=maybe([rng.randrange(VOCAB)], []),
    )


def reference_row(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    return reference_process_row(logits, seq.params, seq.prompt_token_ids, seq.output_token_ids,
                                 banned_tokens(seq, EOS))


@pytest.mark.parametrize("seed", range(6))
def test_process_logits_matches_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    seqs = [make_seq(rng, random_params(rng)) for _ in range(12)]
    seqs.append(make_seq(rng, SamplingParams()))  # a row that asks for nothing
    logits = torch.randn(len(seqs), VOCAB) * 3
    errors: dict = {}
    got = process_logits(logits, seqs, EOS, errors)
    assert not errors
    for i, seq in enumerate(seqs):
        want = reference_row(logits[i], seq)
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got[i])), i
        torch.testing.assert_close(got[i][finite].double(), want[finite], rtol=1e-6, atol=1e-4)
    assert torch.equal(got[-1], logits[-1])
    changed = sum(not torch.equal(got[i], logits[i]) for i in range(len(seqs)))
    assert changed >= len(seqs) // 2  # the settings were actually exercised


def test_process_logits_leaves_plain_batches_alone() -> None:
    rng = random.Random(0)
    seqs = [make_seq(rng, SamplingParams(temperature=0.7)) for _ in range(4)]
    logits = torch.randn(4, VOCAB)
    assert process_logits(logits, seqs, EOS, {}) is logits


def test_penalty_semantics_on_a_hand_made_row() -> None:
    """Repetition over prompt and output (divide positive, multiply negative); frequency and
    presence over the output only, scaled by the count."""
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                            logit_bias={5: -100.0})
    seq = Sequence("r", 0, [1, 2], params)
    seq.token_ids.extend([2, 3, 3, 3])
    logits = torch.tensor([[1.0, 4.0, -4.0, 6.0, 1.0, 9.0]])
    got = process_logits(logits, [seq], set(), {})[0]
    want = torch.tensor([1.0, 2.0, -8.0 - 0.5 - 0.25, 3.0 - 1.5 - 0.25, 1.0, -91.0])
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("seed", range(6))
def test_sampling_probs_match_the_reference(seed: int) -> None:
    rng = random.Random(100 + seed)
    torch.manual_seed(seed)
    params = [random_params(rng) for _ in range(16)]
    params = [p for p in params if not p.greedy] + [SamplingParams(temperature=1e-42), SamplingParams()]
    logits = torch.randn(len(params), VOCAB) * 2
    logits[0, :10] = float("-inf")  # banned tokens arrive as -inf
    got = sampling_probs(logits, params)
    for i, p in enumerate(params):
        want = reference_probs(logits[i], p)
        assert torch.equal(want > 0, got[i] > 0), (i, p)
        torch.testing.assert_close(got[i].double(), want, rtol=1e-5, atol=1e-6)
    sizes = [(row > 0).sum().item() for row in got]
    assert min(sizes) < VOCAB and max(sizes) == VOCAB  # some rows truncated, the plain one not


def test_min_p_keeps_tokens_near_the_top() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.05, 0.03]]))
    probs = sampling_probs(logits, [SamplingParams(min_p=0.2)])[0]
    assert (probs > 0).tolist() == [True, True, True, False, False]  # 0.05 < 0.2 * 0.5 = 0.1
    torch.testing.assert_close(probs[:3], torch.tensor([0.5, 0.3, 0.12]) / 0.92)


def test_greedy_choices_follow_penalties_and_bias() -> None:
    rng = random.Random(7)
    torch.manual_seed(7)
    settings = [SamplingParams(temperature=0, repetition_penalty=1.8),
                SamplingParams(temperature=0, frequency_penalty=2), SamplingParams(temperature=0, presence_penalty=2),
                SamplingParams(top_k=1, logit_bias={3: 100.0}), SamplingParams(temperature=0)]
    seqs = [make_seq(rng, p, out_len=20) for p in settings]
    logits = torch.randn(len(seqs), VOCAB)
    for seq, row in zip(seqs, logits, strict=True):  # the raw favourite, by 0.5, is a generated token: penalties matter
        row[seq.output_token_ids[-1]] = row.max() + 0.5
    out = Sampler(set())(logits, seqs)
    want = [int(reference_row(logits[i], seq).argmax()) for i, seq in enumerate(seqs)]
    assert out.tokens == want and not out.errors
    raw = logits.argmax(-1).tolist()
    assert [a != b for a, b in zip(out.tokens, raw, strict=True)] == [True, True, True, True, False]
    assert out.tokens[3] == 3


def test_seeded_draws_stay_in_the_support_and_do_not_depend_on_the_batch() -> None:
    rng = random.Random(3)
    torch.manual_seed(3)
    params = SamplingParams(temperature=0.8, min_p=0.3, repetition_penalty=1.5, seed=11)
    seq = make_seq(rng, params)
    logits = torch.randn(1, VOCAB) * 2
    support = reference_probs(reference_row(logits[0], seq).float(), params) > 0
    alone = []
    for _ in range(20):
        token = Sampler(EOS)(logits, [seq]).tokens[0]
        assert support[token]
        alone.append(token)
    seq.generator.manual_seed(11)
    others = [make_seq(rng, SamplingParams(temperature=1.0, presence_penalty=1.0)) for _ in range(3)]
    batch_logits = torch.cat([torch.randn(3, VOCAB), logits])
    seq_again = Sequence("r", 0, seq.prompt_token_ids, params)
    seq_again.token_ids = list(seq.token_ids)
    batched = [Sampler(EOS)(batch_logits, others + [seq_again]).tokens[3] for _ in range(20)]
    assert batched == alone and len(set(alone)) > 1


def test_a_bad_row_fails_alone() -> None:
    rng = random.Random(5)
    good = make_seq(rng, SamplingParams(temperature=0, presence_penalty=1.0, logit_bias={1: 5.0}))
    bad_bias = make_seq(rng, SamplingParams(temperature=0, logit_bias={VOCAB + 3: 1.0}))
    nan_temperature = make_seq(rng, SamplingParams(temperature=float("nan")))
    out = Sampler(EOS)(torch.randn(3, VOCAB), [good, bad_bias, nan_temperature])
    assert set(out.errors) == {1, 2} and out.tokens[0] is not None
    assert "outside the vocabulary" in str(out.errors[1])


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("frequency_penalty", float("nan")),
    ("repetition_penalty", 0.0), ("repetition_penalty", float("inf")), ("min_p", 1.5), ("min_p", -0.1),
    ("logit_bias", {1: 101.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {1: float("nan")}),
    ("logit_bias", {"1": 1.0}), ("logit_bias", {1: True}), ("presence_penalty", True),
])
def test_validation_names_the_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()


def test_logit_bias_ids_are_checked_against_the_vocabulary() -> None:
    params = SamplingParams(logit_bias={VOCAB: 1.0})
    params.validate()
    with pytest.raises(ValueError, match=rf"\[0, {VOCAB}\)"):
        params.check_token_ids(VOCAB)
    SamplingParams(logit_bias={VOCAB - 1: 1.0}).check_token_ids(VOCAB)


def test_engine_greedy_with_penalties_matches_full_recompute() -> None:
    """Through the engine (chunked prefill, batching): greedy tokens equal a loop that recomputes
    the whole sequence with the reference model and applies the reference processing."""
    model = toy_model(seed=1)
    settings = [SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.6),
                SamplingParams(max_tokens=16, temperature=0, frequency_penalty=1.5, presence_penalty=0.5),
                SamplingParams(max_tokens=16, temperature=0, logit_bias={65: 8.0, 66: -100.0}, ignore_eos=True)]
    prompts = [[72, 101, 108, 108, 111, 32] * 3, [97, 98, 99] * 5, [120, 121] * 7]
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=100, block_size=4, max_num_batched_tokens=8))
    outs = engine.generate(prompts, settings)
    plain = LLMEngine(model, None, EngineConfig(num_kv_blocks=100, block_size=4)).generate(
        prompts, SamplingParams(max_tokens=16, temperature=0))
    for prompt, params, out, unpenalized in zip(prompts, settings, outs, plain, strict=True):
        ids, want = list(prompt), []
        with torch.no_grad():
            for _ in range(params.max_tokens):
                logits = model(torch.tensor([ids]))[0, -1]
                token = int(reference_process_row(logits, params, prompt, want).argmax())
                want.append(token)
                ids.append(token)
                if token == 258 and not params.ignore_eos:
                    break
        assert out.outputs[0].token_ids == want
        assert want != unpenalized.outputs[0].token_ids  # the settings changed the greedy text
    assert plain[0].outputs[0].token_ids == reference_greedy(model, prompts[0], 16, eos=258)
