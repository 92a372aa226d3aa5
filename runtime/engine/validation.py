"""The one check of a request, run once where the request enters: the server's API boundary (in
the API process, before anything streams) or `LLMEngine.add_request` for offline callers. What
passes becomes an `EngineRequest`, which the engine adds without checking it again."""

from __future__ import annotations

from typing import Any

from lmfoundry.runtime.engine.client import EngineInfo
from lmfoundry.runtime.engine.grammar import GrammarCompiler
from lmfoundry.runtime.engine.sampling_params import SamplingParams


class RequestValidator:
    def __init__(self, info: EngineInfo, tokenizer: Any, grammars: GrammarCompiler | None = None) -> None:
        self.info = info
        self.tokenizer = tokenizer
        # Schemas compile here (and are cached) so a bad one is a 400 before anything runs.
        self.grammars = grammars or GrammarCompiler(tokenizer, info.vocab_size, info.eos_token_ids)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass token ids")
            return list(self.tokenizer(prompt).input_ids)
        return [int(t) for t in prompt]

    def check_ids(self, prompt_ids: list[int]) -> None:
        """Raise ValueError for an empty prompt or a token id outside the vocabulary (the part of
        the check embeddings share with generation)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.info.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request that can never run (the server turns it into a 400)."""
        params.validate()
        self.check_ids(prompt_ids)
        vocab, max_len = self.info.vocab_size, self.info.max_model_len
        if len(prompt_ids) >= max_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; this model's context is "
                             f"{max_len} tokens, prompt and output together")
        if len(prompt_ids) + params.max_tokens > max_len:
            raise ValueError(f"max_tokens {params.max_tokens} plus the prompt's {len(prompt_ids)} tokens "
                             f"exceed the context of {max_len} tokens")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        # The sampler indexes the logits row with these: an id past the vocabulary would fail the step.
        if params.stop_token_ids and max(params.stop_token_ids) >= vocab:
            raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {max(params.stop_token_ids)}")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > vocab:
                raise ValueError(f"{name} must be at most the vocabulary size {vocab}")
        params.check_token_ids(vocab)  # logit_bias ids: refused up front, not failed in the sampler
        if params.constraint is not None:
            self.grammars.check(params.constraint)
