"""Grammar-constrained decoding (structured output) in the engine: the batched grammar masks
against a token-by-token reference, and generation from a random model, which emits garbage
unless constrained, always producing JSON that validates against the schema."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
from toy import byte_tokenizer, toy_model

from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from lmfoundry.runtime.engine.grammar import GrammarCompiler, GrammarMatcher, bitmask_to_allowed, fill_bitmasks
from lmfoundry.runtime.engine.sampler import (
    Sampler,
    banned_tokens,
    process_logits,
    reference_grammar_row,
    reference_process_row,
)
from lmfoundry.runtime.engine.sequence import Sequence

EOS = 258  # the toy tokenizer's <|im_end|>
PADDED_VOCAB = 300  # logits wider than the tokenizer's 259 tokens, as padded real vocabularies are

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "size": {"enum": ["S", "M", "L"]},
    },
    "required": ["name", "age", "member", "tags", "size"],
    "additionalProperties": False,
}
SCHEMAS = [
    PERSON,
    {"type": "object"},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 500}, "maxItems": 4},
    {"enum": ["yes", "no", 3, None]},
    {"type": "string", "pattern": "^[a-c]{2,5}$"},
]


def tid(char: str) -> int:
    """The toy tokenizer's id of a one-byte character (its ids are not the bytes' values)."""
    (token,) = byte_tokenizer()(char, add_special_tokens=False).input_ids
    return token


def compiler(vocab: int = PADDED_VOCAB) -> GrammarCompiler:
    return GrammarCompiler(byte_tokenizer(), vocab, {EOS})


def advanced(matcher: GrammarMatcher, rng: random.Random, steps: int, vocab: int) -> GrammarMatcher:
    """`matcher` after up to `steps` random tokens it allows (checked token by token)."""
    for _ in range(steps):
        if matcher.is_finished:
            break
        allowed = [t for t in range(vocab) if matcher.allows(t)]
        matcher.accept(rng.choice(allowed))
    return matcher


@pytest.mark.parametrize("seed", range(4))
def test_grammar_masks_match_the_token_by_token_reference(seed: int) -> None:
    """Masked logits are -inf exactly where the grammar forbids the token (padding ids past the
    tokenizer included), the other values are the processed logits, and rows without a grammar
    are processed as before, in one batch mixing both with penalties and biases."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    grammars = compiler()
    seqs = []
    for i in range(10):
        schema = SCHEMAS[i % len(SCHEMAS)] if i % 3 else None
        params = SamplingParams(temperature=rng.choice([0.0, 1.0]), json_schema=schema,
                                repetition_penalty=rng.choice([1.0, 1.3]), logit_bias={rng.randrange(259): 5.0})
        seq = Sequence("r", i, [rng.randrange(256) for _ in range(rng.randint(1, 8))], params)
        if schema is not None:
            seq.grammar = advanced(grammars.matcher(schema), rng, rng.randint(0, 12), PADDED_VOCAB)
            seq.token_ids.extend([rng.randrange(256) for _ in range(3)])  # counts for the penalties
        seqs.append(seq)
    logits = torch.randn(len(seqs), PADDED_VOCAB) * 3
    errors: dict = {}
    got = process_logits(logits, seqs, {EOS}, errors)
    assert not errors
    for i, seq in enumerate(seqs):
        want = reference_process_row(logits[i], seq.params, seq.prompt_token_ids, seq.output_token_ids,
                                     banned_tokens(seq, {EOS}))
        if seq.grammar is not None:
            want = reference_grammar_row(want, seq.grammar)
            assert torch.isinf(want[259:]).all()  # ids the tokenizer does not have are never allowed
            assert torch.isfinite(want).sum() < PADDED_VOCAB
        assert torch.equal(torch.isneginf(got[i]), torch.isneginf(want)), i
        finite = torch.isfinite(want)
        assert finite.any()
        torch.testing.assert_close(got[i][finite].double(), want[finite], rtol=1e-6, atol=1e-4)


def test_bitmask_unpacking_reads_every_bit() -> None:
    """Bit b of word w is token 32 w + b, sign bit included; a vocabulary past the bitmask's width
    is padded with forbidden tokens, a narrower one cropped."""
    torch.manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32)
    bitmask[0, 1] = -1  # every bit
    bitmask[1, 2] = -2**31  # only the sign bit: token 95
    for vocab in (100, 128, 150):
        got = bitmask_to_allowed(bitmask, vocab)
        want = [[t < 128 and bool((int(bitmask[r, t // 32]) >> (t % 32)) & 1) for t in range(vocab)]
                for r in range(3)]
        assert got.tolist() == want
    assert bitmask_to_allowed(bitmask, 128)[1, 64:96].tolist() == [False] * 31 + [True]


def test_fill_bitmasks_batches_matchers_of_different_grammars() -> None:
    grammars = compiler()
    matchers = [grammars.matcher(s) for s in SCHEMAS]
    allowed = bitmask_to_allowed(fill_bitmasks(matchers), PADDED_VOCAB)
    for row, matcher in zip(allowed, matchers, strict=True):
        assert row.tolist() == [matcher.allows(t) for t in range(PADDED_VOCAB)]


def generate(engine: LLMEngine, schema: dict, temperatures: list[float], seeds: range, n: int = 2,
             max_tokens: int = 160) -> list:
    params = [SamplingParams(max_tokens=max_tokens, temperature=t, seed=s, n=n, json_schema=schema)
              for t in temperatures for s in seeds]
    outs = engine.generate([f"Person {i}:" for i in range(len(params))], params)
    return [c for out in outs for c in out.outputs]


def toy_engine(**config) -> LLMEngine:
    cfg = dict(num_kv_blocks=512, block_size=8, max_model_len=400, max_num_seqs=32)
    cfg.update(config)
    return LLMEngine(toy_model(seed=2), byte_tokenizer(), EngineConfig(**cfg))


def test_random_model_output_always_matches_the_schema() -> None:
    """Unconstrained, the toy model writes bytes at random; constrained, every sample of every seed
    and temperature is JSON that validates, finished by the grammar (no EOS needed)."""
    engine = toy_engine()
    unconstrained = engine.generate(["Person 0:"], SamplingParams(max_tokens=40, temperature=0))[0].outputs[0]
    with pytest.raises(ValueError):
        jsonschema.validate(json.loads(unconstrained.text), PERSON)
    outputs = generate(engine, PERSON, [0.0, 0.7, 1.0, 1.6], range(3))
    assert len(outputs) == 24
    for out in outputs:
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), PERSON)
        assert EOS not in out.token_ids  # the grammar ended it when the object closed
    assert len({out.text for out in outputs}) > 6  # seeds and temperatures give different objects


@pytest.mark.parametrize("schema", SCHEMAS[2:], ids=["array", "enum", "pattern"])
def test_other_schema_shapes(schema: dict) -> None:
    for out in generate(toy_engine(), schema, [0.0, 1.0], range(2)):
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), schema)


def test_unconstrained_requests_are_unchanged_by_constrained_ones_in_the_batch() -> None:
    """Rows without a grammar get the same tokens alone and batched with grammar rows, greedy and
    seeded (the grammar masks touch only their own rows)."""
    prompts = ["The cat", "A dog", "Some bird"]
    plain = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=24, temperature=0.9, seed=5, ignore_eos=True)]
    alone = toy_engine().generate(prompts[:2], plain)
    constrained = SamplingParams(max_tokens=160, temperature=0.8, seed=1, json_schema=PERSON)
    mixed = toy_engine().generate([prompts[2], prompts[0], prompts[2], prompts[1]],
                                  [constrained, plain[0], constrained, plain[1]])
    assert [mixed[1].outputs[0].token_ids, mixed[3].outputs[0].token_ids] == [o.outputs[0].token_ids for o in alone]
    jsonschema.validate(json.loads(mixed[0].outputs[0].text), PERSON)


def test_ignore_eos_and_max_tokens_with_a_grammar() -> None:
    engine = toy_engine()
    done = engine.generate(["x"], SamplingParams(max_tokens=160, temperature=0, ignore_eos=True,
                                                 json_schema=PERSON))[0].outputs[0]
    assert done.finish_reason == "stop"
    jsonschema.validate(json.loads(done.text), PERSON)
    cut = engine.generate(["x"], SamplingParams(max_tokens=10, temperature=0, json_schema=PERSON))[0].outputs[0]
    assert cut.finish_reason == "length" and done.text.startswith(cut.text)  # greedy: the same prefix


def test_a_grammar_with_no_allowed_token_fails_its_request_alone() -> None:
    """Before min_tokens, stop_token_ids are banned; if they are all the grammar allows, the row
    cannot be sampled: that request fails, the batch goes on."""
    engine = toy_engine()
    stuck = SamplingParams(max_tokens=8, temperature=0, min_tokens=2, stop_token_ids=[tid("t"), tid("f")],
                           json_schema={"type": "boolean"})
    fine = SamplingParams(max_tokens=8, temperature=0, json_schema={"type": "boolean"})
    engine.add_request("stuck", "x", stuck)
    engine.add_request("fine", "x", fine)
    events = []
    while engine.has_unfinished():
        events.extend(engine.step())
    failed = [ev for ev in events if ev.error is not None]
    assert [ev.request_id for ev in failed] == ["stuck"] and "no token is allowed" in str(failed[0].error)
    fine_events = [ev for ev in events if ev.request_id == "fine"]
    assert fine_events[-1].finish_reason == "stop"
    assert json.loads("".join(ev.text for ev in fine_events)) in (True, False)


def test_sampler_fails_a_row_whose_grammar_rejects_its_token(monkeypatch) -> None:
    """If a token the grammar forbids were chosen (a sampler bug), the row fails instead of the
    matcher silently drifting from the output."""
    grammars = compiler()
    seq = Sequence("r", 0, [1, 2], SamplingParams(temperature=0, json_schema={"type": "boolean"}))
    seq.grammar = grammars.matcher({"type": "boolean"})
    monkeypatch.setattr("lmfoundry.runtime.engine.sampler.process_logits", lambda logits, *a: logits)
    logits = torch.zeros(1, PADDED_VOCAB)
    logits[0, tid("x")] = 10.0
    out = Sampler({EOS})(logits, [seq])
    assert out.tokens == [None] and "rejected token" in str(out.errors[0])


@pytest.mark.parametrize("schema,match", [
    ({"type": "nonsense"}, "nonsense"),
    ({"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}, "missing"),
    ({"type": "integer", "minimum": "zero"}, "minimum"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "string", "format": "no-such-format"}, "format"),
])
def test_schemas_that_cannot_be_enforced_are_refused_up_front(schema: dict, match: str) -> None:
    engine = toy_engine()
    with pytest.raises(ValueError, match=match):
        engine.check_request([1, 2], SamplingParams(json_schema=schema))
    with pytest.raises(ValueError, match="json_schema"):
        SamplingParams(json_schema=[{"type": "object"}]).validate()  # type: ignore[arg-type]


def test_compiled_grammars_are_cached_in_schema_key_order() -> None:
    """The same schema compiles once; the same keys in another order are another grammar (llguidance
    writes properties in the schema's order)."""
    grammars = compiler()
    a = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
         "required": ["x", "y"], "additionalProperties": False}
    b = dict(a, properties={"y": a["properties"]["y"], "x": a["properties"]["x"]})
    grammars.check(a)
    grammars.check(json.loads(json.dumps(a)))
    assert len(grammars._compiled) == 1
    first = grammars.matcher(b)
    assert len(grammars._compiled) == 2
    assert first.allows(tid("{"))
    first.accept(tid("{"))
    first.accept(tid('"'))
    assert first.allows(tid("y")) and not first.allows(tid("x"))


def test_preempted_sequences_keep_their_grammar_state() -> None:
    """Preemption recomputes a sequence's KV from its tokens; its matcher, advanced by the same
    tokens, stays valid, so outputs equal those of an engine with room for everyone."""
    prompts = [f"Person {i}:" for i in range(8)]
    params = [SamplingParams(max_tokens=160, temperature=t, seed=i, json_schema=PERSON)
              for i, t in enumerate([0.0, 1.0] * 4)]
    roomy = toy_engine().generate(prompts, params)
    tight_engine = toy_engine(num_kv_blocks=60, block_size=4, max_model_len=200)
    tight = tight_engine.generate(prompts, params)
    assert tight_engine.scheduler.num_preemptions > 0
    for a, b in zip(roomy, tight, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        jsonschema.validate(json.loads(b.outputs[0].text), PERSON)


def test_one_constraint_a_request_and_what_it_names() -> None:
    assert SamplingParams().constraint is None
    assert SamplingParams(regex="a+").constraint == ("regex", "a+")
    assert SamplingParams(grammar='start: "a"').constraint == ("lark", 'start: "a"')
    assert SamplingParams(json_schema={"type": "object"}).constraint == ("json", {"type": "object"})
    with pytest.raises(ValueError, match="json_schema and regex both constrain"):
        SamplingParams(json_schema={"type": "object"}, regex="a+").validate()
    with pytest.raises(ValueError, match="regex must be a string"):
        SamplingParams(regex=5).validate()  # type: ignore[arg-type]


GRAMMAR_WITH_TERMINALS = 'start: "ID-" DIGIT DIGIT DIGIT ("." WORD)?\nDIGIT: /[0-9]/\nWORD: /[a-z]{2,5}/'


# Issue 46: schemas with no finite instance. llguidance compiles them and allows their first
# tokens; decoding then failed a few tokens in ("Too many items (limit 50000)"), as a 500.
UNPRODUCTIVE = {
    "required self": {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
    "nonempty children": {"$defs": {"node": {"type": "object", "required": ["kids"], "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "minItems": 1}}}}, "$ref": "#/$defs/node"},
    "first item": {"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1},
    "every branch": {"anyOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/definitions/b"}],
                     "$defs": {"a": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
                     "definitions": {"b": {"type": "array", "items": {"$ref": "#/definitions/b"}, "minItems": 2}}},
    "bare self": {"$ref": "#"},
}
# Recursive schemas that can end: served, and every finished output validates.
RECURSIVE = {
    "tree": {"$defs": {"node": {"type": "object", "required": ["v"], "additionalProperties": False, "properties": {
        "v": {"type": "integer", "minimum": 0, "maximum": 9},
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}}}, "$ref": "#/$defs/node"},
    "list or null": {"definitions": {"cell": {"type": ["object", "null"], "required": ["next"],
                                              "additionalProperties": False,
                                              "properties": {"next": {"$ref": "#/definitions/cell"}}}},
                     "$ref": "#/definitions/cell"},
    "one good branch": {"anyOf": [{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"],
                                   "additionalProperties": False}, {"type": "boolean"}]},
}


@pytest.mark.parametrize("schema", UNPRODUCTIVE.values(), ids=UNPRODUCTIVE.keys())
def test_schemas_without_a_finite_instance_are_refused_up_front(schema: dict, monkeypatch) -> None:
    engine = toy_engine()
    with pytest.raises(ValueError, match="no finite instance"):
        engine.check_request([1, 2], SamplingParams(json_schema=schema))
    # What the check spares: past it, decoding cannot finish (the grammar fails the request within a
    # few tokens), unless the first-step probe already sees it.
    monkeypatch.setattr("lmfoundry.runtime.engine.grammar.unproductive", lambda kind, source: None)
    try:
        engine.check_request([1, 2], SamplingParams(json_schema=schema))
    except ValueError as exc:
        assert "cannot be decoded" in str(exc)
        return
    engine.add_request("r", [1, 2], SamplingParams(max_tokens=64, temperature=1.0, seed=0, json_schema=schema))
    events = []
    while engine.has_unfinished():
        events += engine.step()
    assert events[-1].error is not None and "Too many items" in str(events[-1].error)


@pytest.mark.parametrize("schema", RECURSIVE.values(), ids=RECURSIVE.keys())
def test_recursive_schemas_that_can_end_are_served(schema: dict) -> None:
    outputs = generate(toy_engine(), schema, [0.0, 1.0], range(3))
    assert any(out.finish_reason == "stop" for out in outputs)
    for out in outputs:
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.parametrize("grammar", ['start: a\na: "x" a', 'start: a | b\na: "x" a\nb: "y" b',
                                     'start: x{2,3} "e"\nx: "q" x', '// c\nstart: "a" b\n    | b "c"\nb: b'])
def test_lark_grammars_without_a_finite_output_are_refused_up_front(grammar: str) -> None:
    with pytest.raises(ValueError, match="no finite output"):
        compiler().check(("lark", grammar))


@pytest.mark.parametrize("grammar", ['start: a\na: "x" a | "y"', 'start: x~0..2 "e"\nx: "q" x',
                                     'start: list\nlist: "[" [list ("," list)*] "]"', GRAMMAR_WITH_TERMINALS])
def test_lark_grammars_that_can_end_compile(grammar: str) -> None:
    compiler().check(("lark", grammar))


def test_the_first_step_probe_refuses_what_cannot_start_or_never_ends() -> None:
    """The probe behind the static checks: a regular expression that matches nothing, and (the
    static check bypassed) a grammar whose forced output runs on forever."""
    with pytest.raises(ValueError, match="allows no output"):
        compiler().check(("regex", "[^\\s\\S]"))
    with pytest.raises(ValueError, match="never ends"):
        compiler()._compile("lark", 'start: a\na: "x" a')
