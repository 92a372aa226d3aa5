"""Grammar-constrained decoding (structured output) with llguidance.

A request with a constraint (`SamplingParams.constraint`: a JSON schema, a regular expression, or
a Lark grammar) may only produce text that matches it. Each of its sequences carries a `GrammarMatcher` (the position of its output in the
grammar); at every step the sampler asks the matchers of the batch for their token masks, sets the
logits of the tokens the grammar forbids to -inf (see `sampler.apply_grammar_masks`), and after
choosing advances each matcher with its token. When a matcher can take nothing but EOS (the JSON
value is complete), the engine finishes the sequence with "stop".

Pieces, and why they are where they are:

* `GrammarCompiler` (one per engine) turns a schema into llguidance's grammar and its initial
  matcher state. Compiling is the expensive part (milliseconds to a second for large schemas, and
  about a second once to convert a large vocabulary), so it happens in `LLMEngine.check_request`,
  which the server runs in its request-preparation threads, and the result is cached per schema:
  the engine thread only deep-copies a compiled matcher when a sequence is added.
* `GrammarMatcher` wraps one sequence's llguidance matcher.
* `fill_bitmasks` computes the masks of several matchers at once on the CPU (llguidance's thread
  pool, outside the GIL) into one [rows, words] int32 bitmask, bit t % 32 of word t // 32 set when
  token t is allowed; `bitmask_to_allowed` unpacks it on the logits' device, so only the compact
  bitmask crosses to an accelerator.

JSON layout: whitespace is not left to the model. Separators are fixed to ", " and ": " (what
Python's `json.dumps` writes) and no other whitespace is allowed. A grammar that allows any
whitespace anywhere lets a small or uncertain model emit newlines and spaces until max_tokens; a
fixed layout keeps every output short and parseable at the cost of the model's own indentation.

llguidance is imported on first use, so engines that never see a structured request never load it;
torch only by the two mask functions, which the engine calls: the API process validates and
compiles grammars without it.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Iterable

from lmfoundry.runtime.engine.grammar_checks import probe_matcher, unproductive

if TYPE_CHECKING:
    import torch
    from llguidance import LLExecutor, LLMatcher, LLTokenizer
    from llguidance._lib import JsonCompileOptions

# llguidance's JSON compile options (see the module docstring for why whitespace is fixed).
JSON_LAYOUT: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
Constraint = tuple[str, Any]  # ("json", schema dict) | ("regex", pattern) | ("lark", grammar text)
GRAMMAR_CACHE_SIZE = 256  # compiled schemas kept per engine (tool-call schemas repeat across requests)
MAX_SCHEMA_CHARS = 1_000_000  # a schema larger than this (as JSON text) is refused before compiling


class GrammarMatcher:
    """One sequence's state in its grammar: which tokens may come next, advanced token by token."""

    def __init__(self, matcher: LLMatcher, vocab_words: int, eos_token_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.vocab_words = vocab_words  # int32 words of this matcher's bitmask (ceil(vocab / 32))
        self.eos_token_ids = eos_token_ids

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a token it did not allow, a grammar resource limit), or None.
        llguidance never raises for these: it enters an error state and stays there."""
        return (self.matcher.get_error() or "error") if self.matcher.is_error() else None

    @property
    def is_finished(self) -> bool:
        """The output is complete: the grammar accepts it and allows nothing but EOS next."""
        return not self.matcher.is_error() and self.matcher.is_stopped()

    def allows(self, token: int) -> bool:
        """Whether `token` may come next, asked token by token without the mask (tests compare the
        batched masks with this). A finished matcher takes only EOS (llguidance's token validation
        refuses even EOS once the matcher has stopped, while its mask and `consume_token` accept it)."""
        if self.matcher.is_error():
            return False
        if self.matcher.is_stopped():
            return token in self.eos_token_ids
        return self.matcher.validate_tokens([token]) == 1

    def accept(self, token: int) -> None:
        """Advance with the chosen token; ValueError if the grammar did not allow it (the sampler
        masks every disallowed token, so this means a bug or a grammar error)."""
        if not self.matcher.consume_token(token):
            raise ValueError(f"the output grammar rejected token {token}: {self.matcher.get_error()}")


@functools.cache
def _executor() -> LLExecutor:
    """llguidance's thread pool for batched masks (80% of the CPUs, at most 32, by default)."""
    from llguidance import LLExecutor

    return LLExecutor()


def fill_bitmasks(matchers: list[GrammarMatcher]) -> torch.Tensor:
    """The next-token bitmasks of `matchers`, computed together: int32 [len(matchers), words] on
    the CPU; bit b of word w is set when token 32 * w + b is allowed. Callers leave out matchers in
    their error state (`apply_grammar_masks` fails those rows instead)."""
    import torch  # here, not above: the API process compiles grammars and never imports torch

    words = max(m.vocab_words for m in matchers)
    bitmask = torch.zeros((len(matchers), words), dtype=torch.int32)
    # What llguidance.torch.fill_next_token_bitmask_par does, without importing that module: it
    # decorates a helper with torch.compile, and the import alone costs about a second.
    _executor().unsafe_compute_mask_ptr([(m.matcher, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                        words * bitmask.element_size(), len(matchers))
    return bitmask


def bitmask_to_allowed(bitmask: torch.Tensor, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Unpack a [rows, words] int32 bitmask into bool [rows, vocab] on `device`: True where the
    token is allowed. Columns past the bitmask's 32 * words tokens are False (ids the grammar's
    tokenizer does not know)."""
    import torch

    packed = bitmask.to(device)
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)
    # An arithmetic right shift keeps the low bit right for negative words (bit 31 set) too.
    allowed = ((packed.unsqueeze(-1) >> shifts) & 1).bool().reshape(packed.shape[0], -1)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return allowed[:, :vocab]


def advance(matchers: list[GrammarMatcher], tokens: list[int]) -> list[bool]:
    """Advance each matcher with its token; False where the grammar rejected it (that matcher is
    then in its error state). One token costs microseconds, so this runs in the calling thread."""
    return [m.matcher.consume_token(t) for m, t in zip(matchers, tokens, strict=True)]


class GrammarCompiler:
    """Compiles JSON schemas into llguidance matchers for one engine's tokenizer and vocabulary.

    Thread-safe: the server's preparation threads compile (`check`) while the engine thread makes
    matchers for new sequences (`matcher`). The llguidance tokenizer is built on first use from the
    model's Hugging Face fast tokenizer, with the engine's EOS ids and a vocabulary as large as the
    model's logits (a model's vocabulary is often padded past the tokenizer's; those ids are never
    allowed)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_size = cache_size
        self._ll_tokenizer: LLTokenizer | None = None
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # guards the cache
        self._tokenizer_lock = threading.Lock()  # the llguidance tokenizer is built once

    def _llg_tokenizer(self) -> LLTokenizer:
        with self._tokenizer_lock:
            return self._build_llg_tokenizer()

    def _build_llg_tokenizer(self) -> LLTokenizer:
        if self._ll_tokenizer is None:
            try:
                import llguidance.hf
            except ImportError as exc:  # a dependency of the package; say what is missing
                raise ValueError(f"structured output needs the llguidance package ({exc})") from None
            from transformers import PreTrainedTokenizerFast

            if not isinstance(self.tokenizer, PreTrainedTokenizerFast):
                raise ValueError("structured output needs the model's Hugging Face fast tokenizer")
            if not self.eos_token_ids:
                raise ValueError("structured output needs an EOS token id (the model config and tokenizer have none)")
            n_vocab = max(self.vocab_size, len(self.tokenizer))
            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=n_vocab,
                                                                  eos_token=self.eos_token_ids)
            except Exception as exc:  # noqa: BLE001 - a tokenizer llguidance cannot read: refuse the request
                raise ValueError(f"structured output is not available for this model's tokenizer: {exc}") from None
        return self._ll_tokenizer

    @property
    def vocab_words(self) -> int:
        """int32 words of one token bitmask."""
        return (self._llg_tokenizer().vocab_size + 31) // 32

    def _compile(self, kind: str, source: str) -> LLMatcher:
        """Compile a constraint (`kind` "json": a schema's JSON text, "regex", "lark") and return
        its matcher at the start."""
        from llguidance import LLMatcher

        tokenizer = self._llg_tokenizer()
        what = {"json": "JSON schema", "regex": "regular expression", "lark": "grammar"}[kind]
        try:
            if kind == "json":
                grammar = LLMatcher.grammar_from_json_schema(source, overrides=JSON_LAYOUT)
            elif kind == "regex":
                grammar = LLMatcher.grammar_from_regex(source)
            else:
                grammar = LLMatcher.grammar_from_lark(source)
        except ValueError as exc:
            raise ValueError(f"invalid {what}: {exc}") from None
        if message := LLMatcher.validate_grammar(grammar, tokenizer):
            raise ValueError(f"unsupported or invalid {what}: {message}")
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"unsupported or invalid {what}: {matcher.get_error()}")
        if (why := probe_matcher(matcher)) is not None:
            raise ValueError(f"the {what} cannot be decoded: {why}")
        return matcher

    def _initial(self, constraint: Constraint | dict[str, Any]) -> LLMatcher:
        """The compiled matcher of a constraint at its start (cached); a bare dict is a JSON
        schema. A schema's key keeps its key order: llguidance emits properties in the order the
        schema lists them."""
        kind, source = ("json", constraint) if isinstance(constraint, dict) else constraint
        if kind == "json":
            if not isinstance(source, dict):
                raise ValueError(f"a JSON schema must be a JSON object, got {type(source).__name__}")
            try:
                text = json.dumps(source, ensure_ascii=False, allow_nan=False)
            except (TypeError, ValueError) as exc:  # offline callers can pass any dict
                raise ValueError(f"a JSON schema must be plain JSON: {exc}") from None
        elif kind in ("regex", "lark") and isinstance(source, str):
            text = source
        else:
            raise ValueError(f"unknown output constraint {kind!r}")
        if len(text) > MAX_SCHEMA_CHARS:
            raise ValueError(f"the output constraint is larger than {MAX_SCHEMA_CHARS} characters")
        key = f"{kind}\0{text}"
        with self._lock:
            if (hit := self._compiled.get(key)) is not None:
                self._compiled.move_to_end(key)
                return hit
        # Compiled outside the lock: a large schema takes a while, and the engine thread must not
        # wait for it to make matchers of cached schemas (two threads may compile the same schema).
        if (why := unproductive(kind, source)) is not None:
            raise ValueError(f"unsupported {'JSON schema' if kind == 'json' else 'grammar'}: {why}")
        compiled = self._compile(kind, text)
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return compiled

    def check(self, constraint: Constraint | dict[str, Any]) -> None:
        """Raise ValueError (a 400 at the server) for a constraint that cannot constrain decoding:
        a schema that is not a JSON object, invalid, uses keywords llguidance cannot enforce, or has
        no finite instance; a regular expression or grammar that does not compile, or that fails its
        first step (grammar_checks.py)."""
        self._initial(constraint)

    def matcher(self, constraint: Constraint | dict[str, Any]) -> GrammarMatcher:
        """A fresh matcher for one sequence (a copy of the cached compiled state)."""
        initial = self._initial(constraint)
        with self._lock:  # the cached state is shared: copy it while no other thread does
            copy = initial.deep_copy()
        return GrammarMatcher(copy, self.vocab_words, frozenset(self.eos_token_ids))
