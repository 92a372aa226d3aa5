"""Issue 16, engine side: values that break the sampler are refused up front, and a request that
still fails inside a step fails alone (its blocks freed, the batch's other requests unaffected).

| case                                      | before                            | after                          | test                                         |
|-------------------------------------------|-----------------------------------|--------------------------------|----------------------------------------------|
| temperature NaN / inf, bools or floats    | accepted; the step or torch later | ValueError from check_request  | test_sampler_breaking_values_are_refused     |
| as ints, seed -1 / 2**64 / 1.5, stop ids  | raised (IndexError, NaN probs,    | (the server's 400)             |                                              |
| >= vocab or < 0, non-str stop             | seed overflow)                    |                                |                                              |
| temperature -inf, top_p NaN, max_tokens   | ValueError                        | ValueError (regression guards) | test_sampler_breaking_values_are_refused     |
| 4.0                                       |                                   |                                |                                              |
| temperature 1e-42 / 1e-320 / 5e-324       | RuntimeError: NaN probabilities   | samples the greedy token       | test_tiny_temperature_samples                |
| seed 2**64 - 1 with n=2 (seed + index)    | RuntimeError: seed overflow       | wraps to 0, runs               | test_largest_seed_with_n_runs                |
| one request's sampling fails mid-batch    | step raised: all requests aborted | that request alone gets an     | test_failing_request_fails_alone             |
|                                           |                                   | "error" event; blocks freed    |                                              |
| forward pass fails                        | step raised: all requests aborted | the batch's requests fail,     | test_forward_failure_spares_waiting_requests |
|                                           | (waiting ones too)                | waiting ones run               |                                              |
| offline generate with a failing request   | raised; requests and blocks left  | RuntimeError; engine clean and | test_offline_generate_raises_and_cleans_up   |
|                                           | behind                            | reusable                       |                                              |
"""

from __future__ import annotations

import math

import pytest
from helpers import poison_sampler
from toy import byte_tokenizer, toy_model

from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams

VOCAB = 259


@pytest.fixture(scope="module")
def model():
    return toy_model(seed=1)


def make_engine(model, **cfg) -> LLMEngine:
    return LLMEngine(model, byte_tokenizer(), EngineConfig(num_kv_blocks=64, block_size=4, **cfg))


BAD_PARAMS = [
    {"temperature": math.nan},
    {"temperature": math.inf},
    {"temperature": -math.inf},
    {"temperature": True},
    {"top_p": math.nan},
    {"top_k": 2.5},
    {"top_k": True},
    {"n": True},
    {"max_tokens": True},
    {"max_tokens": 4.0},
    {"logprobs": True},
    {"logprobs": 2.5},
    {"seed": -1},
    {"seed": 2**64},
    {"seed": 1.5},
    {"stop_token_ids": [VOCAB]},
    {"stop_token_ids": [-1]},
    {"stop_token_ids": ["a"]},
    {"stop": [1]},
    {"min_tokens": 1.5},
]


@pytest.mark.parametrize("kwargs", BAD_PARAMS, ids=repr)
def test_sampler_breaking_values_are_refused(model, kwargs) -> None:
    engine = make_engine(model)
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        engine.check_request([1, 2, 3], SamplingParams(**kwargs))


@pytest.mark.parametrize("temperature", [1e-42, 1e-320, 5e-324])
def test_tiny_temperature_samples(model, temperature: float) -> None:
    engine = make_engine(model)
    params = SamplingParams(max_tokens=6, temperature=temperature, seed=3, ignore_eos=True)
    sampled = engine.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    greedy = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert sampled == greedy[0].outputs[0].token_ids


def test_largest_seed_with_n_runs(model) -> None:
    engine = make_engine(model)
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, seed=2**64 - 1, n=2, ignore_eos=True))[0]
    assert [len(o.token_ids) for o in out.outputs] == [4, 4]


def run_all(engine: LLMEngine) -> dict[str, list]:
    events: dict[str, list] = {}
    while engine.has_unfinished():
        for ev in engine.step():
            events.setdefault(ev.request_id, []).append(ev)
    return events


def test_failing_request_fails_alone(model) -> None:
    prompts = [[10 + i, 20, 30] for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0.7, seed=1, ignore_eos=True)
    clean = make_engine(model)
    want = [o.outputs[0].token_ids for o in clean.generate(prompts, params)]

    engine = make_engine(model)
    rids = [engine.add_request(None, p, SamplingParams(**vars(params))) for p in prompts]
    poisoned = SamplingParams(max_tokens=8, temperature=0.7, n=2)
    bad = engine.add_request("bad", [1, 2, 3], poisoned)
    poisoned.temperature = math.nan  # after admission, as a value that slipped past validation would
    events = run_all(engine)

    assert [ev.finish_reason for ev in events[bad]] == ["error"]
    assert events[bad][0].request_finished and "nan" in str(events[bad][0].error)
    assert [[t for ev in events[r] for t in ev.token_ids] for r in rids] == want
    assert engine.block_manager.num_used_blocks == 0 and not engine.scheduler.has_work()


def test_forward_failure_spares_waiting_requests(model) -> None:
    engine = make_engine(model, max_num_seqs=1)
    first = engine.add_request(None, [1, 2, 3], SamplingParams(max_tokens=3, temperature=0))
    second = engine.add_request(None, [4, 5, 6], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    execute = engine.runner.execute
    calls = []

    def fail_first(batch):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return execute(batch)

    engine.runner.execute = fail_first
    events = run_all(engine)
    assert [ev.finish_reason for ev in events[first]] == ["error"]
    assert sum(len(ev.token_ids) for ev in events[second]) == 3
    assert events[second][-1].finish_reason == "length"
    assert engine.block_manager.num_used_blocks == 0


def test_offline_generate_raises_and_cleans_up(model, monkeypatch) -> None:
    engine = make_engine(model)
    poison_sampler(monkeypatch)
    good = SamplingParams(max_tokens=20, temperature=0.5, seed=1, ignore_eos=True)
    with pytest.raises(RuntimeError, match="poisoned sampler row"):
        engine.generate([[1, 2, 3], [4, 5, 6]], [good, SamplingParams(max_tokens=20, temperature=0.5, seed=666)])
    assert not engine.has_unfinished() and engine.block_manager.num_used_blocks == 0
    assert len(engine.generate([[1, 2, 3]], good)[0].outputs[0].token_ids) == 20
