"""lm-eval model class backed by lmfoundry's runtime: the gate scores the code that serves.

`RuntimeLM` is registered with lm-eval as `lmfoundry` when this module is imported. lm-eval has
no plugin mechanism for models, so its stock CLI cannot find it by itself: `lmfoundry eval harness
--model lmfoundry --model_args pretrained=out/ --tasks ...` imports it and runs lm-eval's own CLI
with the rest of the arguments.

Two execution paths. With `serving` (what eval-gate runs, and always for an engine bundle or a
tensor-parallel model) everything goes through the serving engine (`LLMEngine`, the module swaps,
paged attention kernels and step budget `serve` uses, in the dtype it serves): scoring is the
prompt logprobs an echo request to `serve` returns, so `lm_eval --model local-completions`
against `serve` with the same settings scores the same numbers (bit for bit with
`deterministic`, which makes every number independent of how requests are batched). Without it,
scoring (`loglikelihood`, `loglikelihood_rolling`) runs the reference `CausalLM` forward directly,
one batched forward per group of requests (no KV cache involved, fast on CPU), and only
generation (`generate_until`) goes through the serving engine (greedy).

Prompt settings are pinned and reported (`prompt_settings()`), because they move accuracies by
points: whether a BOS token is prepended, and whether the chat template is applied (the latter is
lm-eval's `apply_chat_template`, which calls `apply_chat_template` below).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, cast

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from lmfoundry.errors import UserError
from lmfoundry.model.attention_math import AttentionSpec
from lmfoundry.model.reference import CausalLM, DecoderLayer

if TYPE_CHECKING:
    from lmfoundry.runtime.engine.llm_engine import LLMEngine
    from lmfoundry.runtime.engine.ranks import ShardedModel
    from lmfoundry.runtime.kernel_model import KernelModel

BOS_CHOICES = ("tokenizer", "true", "false")


def parse_add_bos(value: Any) -> str:
    """Normalize an add_bos setting: "tokenizer" (whatever the tokenizer does by default, as
    lm-eval's hf backend), "true" (always exactly one BOS first) or "false" (never)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value).strip().lower() if value is not None else "tokenizer"
    if text in ("none", "null", "auto", "default"):
        text = "tokenizer"
    if text not in BOS_CHOICES:
        raise UserError(f"add_bos {value!r}: expected true, false or tokenizer")
    return text


@dataclass
class Scored:
    """What one output position contributes: the log-probabilities of the tokens asked for, and
    the greedy token."""

    logprob: dict[int, float]
    argmax: int

    @classmethod
    def of(cls, logprobs: torch.Tensor, tokens: Iterable[int]) -> "Scored":
        return cls({t: float(logprobs[t]) for t in tokens}, int(logprobs.argmax()))


@dataclass
class ScoreRequest:
    """One (context, continuation) scoring job in token ids."""

    context: list[int]
    continuation: list[int]


class PrefixCache:
    """`AttentionContext` that records each layer's K/V for a batch of prefixes, then lets a batch
    of extensions (row r continues prefix `rows[r]`) attend to them.

    The model hands attention to its context instead of running its own causal attention, and
    skips its KV quantize round trip then; both are done here exactly as the model would, so a
    checkpoint with a quantized KV cache is scored with it. Padded prefix positions are masked."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.rows: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None

    def extend(self, rows: list[int], prefix_lengths: list[int]) -> None:
        device = self.model.device  # not lm_head.weight: a served model's head unpacks a copy for that
        self.rows = torch.tensor(rows, dtype=torch.long, device=device)
        self.lengths = torch.tensor(prefix_lengths, dtype=torch.long, device=device)[self.rows]

    supports_attention_spec = True  # honours Gemma's AttentionSpec (scale, soft-cap, window)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               spec: AttentionSpec | None = None) -> torch.Tensor:
        from lmfoundry.model.attention_math import causal_attention, spec_attention

        round_trip = cast(DecoderLayer, self.model.model.layers[layer_idx]).self_attn.kv_round_trip
        if round_trip is not None:
            k, v = round_trip(k, v)
        if self.rows is None:  # prefix pass: plain causal attention, keep K/V
            self.kv[layer_idx] = (k, v)
            return causal_attention(q, k, v) if spec is None else spec_attention(q, k, v, spec)
        assert self.lengths is not None  # set with rows by extend()
        kp, vp = self.kv[layer_idx]
        keys = torch.cat([kp[self.rows], k], dim=1)
        values = torch.cat([vp[self.rows], v], dim=1)
        tp, te = kp.shape[1], k.shape[1]
        mask = torch.cat([
            (torch.arange(tp, device=q.device)[None, :] < self.lengths[:, None])[:, None, :].expand(-1, te, -1),
            torch.ones(te, te, dtype=torch.bool, device=q.device).tril()[None].expand(q.shape[0], -1, -1),
        ], dim=2)
        if spec is not None:  # absolute positions: row r's extension follows its prefix of lengths[r]
            q_pos = self.lengths[:, None] + torch.arange(te, device=q.device)[None, :]  # [B, te]
            k_pos = torch.cat([torch.arange(tp, device=q.device).expand(q.shape[0], -1), q_pos], dim=1)
            return spec_attention(q, keys, values, spec, q_pos, k_pos, mask)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask[:, None], enable_gqa=True)
        return out.transpose(1, 2)


def parse_flag(name: str, value: Any) -> bool:
    """A boolean model_arg (lm-eval passes "true"/"false" strings)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", "none", ""):
        return False
    raise UserError(f"{name} {value!r}: expected true or false")


def _available_device(device: str | None) -> str:
    """lm-eval's --device (it defaults to cuda) where it exists, else the CPU with a warning."""
    if device in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        import logging

        logging.getLogger("lmfoundry.evals").warning("--device %s: no CUDA GPU here; evaluating on the CPU", device)
        return "cpu"
    return str(device)


@register_model("lmfoundry")
class RuntimeLM(TemplateLM):
    """lm-eval `LM` over an lmfoundry `CausalLM` (float or quantized) and its tokenizer."""

    def __init__(
        self,
        model: CausalLM | ShardedModel | KernelModel | None = None,
        tokenizer: Any = None,
        pretrained: str | None = None,
        add_bos: Any = "tokenizer",
        batch_tokens: int = 4096,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        engine_config: Any = None,
        device: str | None = None,
        dtype: str = "auto",
        serving: Any = False,
        deterministic: Any = False,
        progress: Any = True,
        **_: Any,
    ) -> None:
        super().__init__()
        if model is None:
            if pretrained is None:
                raise UserError("the lmfoundry lm-eval model needs `pretrained=` (a folder, GGUF or built-in name)")
            from lmfoundry.runtime.loader import load_model, resolve_dtype

            device = _available_device(device)
            model, tokenizer = load_model(pretrained, dtype=resolve_dtype(str(dtype), pretrained, device),
                                          device=device)
        if tokenizer is None:
            raise UserError("the lmfoundry lm-eval model needs a tokenizer")
        from lmfoundry.runtime.engine.ranks import ShardedModel
        from lmfoundry.runtime.kernel_model import KernelModel

        # An engine bundle's kernels and a tensor-parallel model's ranks are driven through the
        # serving engine (paged cache, prefix caching of shared contexts); the reference model
        # through its own batched scoring, or through the serving engine too with `serving`.
        self.deterministic = parse_flag("deterministic", deterministic)
        self.progress = parse_flag("progress", progress)  # False: no progress bar, lm-eval's included
        self.kernel_model = isinstance(model, KernelModel)
        self.on_engine = self.kernel_model or isinstance(model, ShardedModel) or self.deterministic \
            or parse_flag("serving", serving)
        self.model: CausalLM | ShardedModel | KernelModel = (
            model if self.on_engine else cast(CausalLM, model).eval())
        self.tokenizer = tokenizer
        self.add_bos = parse_add_bos(add_bos)
        self.batch_tokens = int(batch_tokens)
        self._max_length = int(max_length) if max_length else int(model.config.max_position_embeddings)
        self._max_gen_toks = int(max_gen_toks)
        self._engine_config = engine_config
        self._engine: LLMEngine | None = None

    # ---- identity and tokenization --------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """Conditioning token for an empty context (and rolling windows): BOS, else EOS."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def device(self) -> torch.device:
        if self.on_engine:
            return getattr(self.model, "device", torch.device("cpu"))
        return cast(CausalLM, self.model).device

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "") .replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of `string`. With add_special_tokens=None the pinned BOS policy applies; a
        string that already starts with the BOS text never gets a second one."""
        bos_text = self.tokenizer.bos_token
        if add_special_tokens is not None:
            ids = self.tokenizer.encode(string, add_special_tokens=add_special_tokens)
        elif bos_text and string.startswith(bos_text):
            ids = self.tokenizer.encode(string, add_special_tokens=False)
        elif self.add_bos == "tokenizer":
            ids = self.tokenizer.encode(string)
        else:
            ids = self.tokenizer.encode(string, add_special_tokens=False)
            if self.add_bos == "true" and self.tokenizer.bos_token_id is not None:
                ids = [self.tokenizer.bos_token_id] + ids
        return list(ids)

    def tok_decode(self, tokens: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    def bos_prepended(self) -> bool:
        """Whether a plain prompt actually starts with BOS under the pinned policy."""
        bos = self.tokenizer.bos_token_id
        return bos is not None and self.tok_encode("a")[:1] == [bos]

    def execution(self) -> dict[str, Any]:
        """How this model is executed (recorded in eval-gate's report): the serving engine or the
        reference forward, in which dtype, deterministic or not."""
        return {"path": "serving engine" if self.on_engine else "reference forward",
                "dtype": str(self.model.dtype).removeprefix("torch."), "deterministic": self.deterministic}

    def prompt_settings(self) -> dict[str, Any]:
        return {"add_bos": self.add_bos, "bos_prepended": self.bos_prepended(),
                "bos_token": self.tokenizer.bos_token, "prefix_token_id": self.prefix_token_id,
                "max_length": self.max_length, "has_chat_template": bool(getattr(self.tokenizer, "chat_template", None))}

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise UserError("chat template requested but the tokenizer has none")
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if not chat_template:
            return None
        return getattr(self.tokenizer, "chat_template", None)

    # ---- scoring --------------------------------------------------------------------------
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """lm-eval's tokenization of the requests (its own progress bar, off without `progress`),
        then `_loglikelihood_tokens`."""
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        jobs = [ScoreRequest(list(ctx), list(cont)) for _, ctx, cont in requests]
        results = self.score(jobs, progress=not disable_tqdm)
        for (key, _, _), res in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
        return results

    @torch.no_grad()
    def score(self, jobs: list[ScoreRequest], progress: bool = False) -> list[tuple[float, bool]]:
        """(sum log P(continuation | context), continuation is the greedy choice) per job.

        Each job is the causal sequence context+continuation[:-1], left-truncated to max_length
        as lm-eval does, split into a *prefix* (up to the token that predicts the first
        continuation token) and an *extension* (the rest of the continuation). Jobs that share a
        prefix (the choices of one multiple-choice question) run the prefix once: a batch of
        distinct prefixes goes through the model recording each layer's K/V (`PrefixCache`), then
        all extensions of those prefixes run as one batch attending to the recorded K/V. This is
        the same computation as one full forward per job (exact up to float rounding) with
        roughly half the tokens. Batches are sorted by length, ties by content, so results do not
        depend on request order. Only needed positions go through the LM head; log-softmax is
        taken in float32."""
        if self.on_engine:
            return self._score_on_engine(jobs)
        model = cast(CausalLM, self.model)  # not on the engine: the reference model
        parts: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        for job in jobs:
            n = self._checked_length(job)
            seq = (job.context + job.continuation)[-(self.max_length + 1):][:-1]
            parts.append((tuple(seq[: len(seq) - n + 1]), tuple(seq[len(seq) - n + 1 :])))
        groups: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
        need_first: dict[tuple[int, ...], set[int]] = {}  # prefix -> tokens its last position must score
        need_last: dict[tuple[tuple[int, ...], tuple[int, ...]], set[int]] = {}
        for (prefix, ext), job in zip(parts, jobs, strict=True):
            groups.setdefault(prefix, set()).add(ext)
            need_first.setdefault(prefix, set()).add(job.continuation[0])
            if ext:
                need_last.setdefault((prefix, ext), set()).add(job.continuation[-1])
        order = sorted(groups, key=lambda p: (-len(p), p))
        # Only the log-probabilities that jobs ask for are kept (not vocabulary-sized rows): memory
        # stays flat however many requests a task has.
        first: dict[tuple[int, ...], Scored] = {}
        rest: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[float, bool, Scored]] = {}
        bar = tqdm(total=len(jobs), desc="loglikelihood", unit="req", disable=not progress)
        i = 0
        while i < len(order):
            rows = max(1, self.batch_tokens // len(order[i]))
            batch = order[i : i + rows]
            exts = [(g, e) for g, p in enumerate(batch) for e in sorted(groups[p]) if e]
            cache = PrefixCache(model) if exts else None
            hidden = model.hidden_states(*self._padded(batch, [0] * len(batch)), context=cache)
            for g, p in enumerate(batch):
                first[p] = Scored.of(F.log_softmax(model.lm_head(hidden[g, len(p) - 1]).float(), -1), need_first[p])
            exts.sort(key=lambda x: (-len(x[1]), x))
            j = 0
            while j < len(exts):  # extensions in chunks of at most batch_tokens tokens too
                chunk = exts[j : j + max(1, self.batch_tokens // len(exts[j][1]))]
                assert cache is not None  # made whenever there are extensions
                cache.extend([g for g, _ in chunk], [len(p) for p in batch])
                ids, pos = self._padded([e for _, e in chunk], [len(batch[g]) for g, _ in chunk])
                hidden = model.hidden_states(ids, pos, context=cache)
                for r, (g, e) in enumerate(chunk):
                    lp = F.log_softmax(model.lm_head(hidden[r, : len(e)]).float(), dim=-1)
                    inner = torch.tensor(e[1:], dtype=torch.long, device=lp.device)  # targets of all but the last
                    total = float(lp[:-1].gather(1, inner[:, None]).sum()) if len(e) > 1 else 0.0
                    greedy = bool((lp[:-1].argmax(-1) == inner).all()) if len(e) > 1 else True
                    rest[(batch[g], e)] = (total, greedy, Scored.of(lp[-1], need_last[(batch[g], e)]))
                j += len(chunk)
            i += len(batch)
            bar.update(sum(1 for p, _ in parts if p in set(batch)))
        bar.close()
        out = []
        for (prefix, ext), job in zip(parts, jobs, strict=True):
            head = first[prefix]
            ll, greedy = head.logprob[job.continuation[0]], head.argmax == job.continuation[0]
            if ext:
                total, inner_greedy, last = rest[(prefix, ext)]
                ll += total + last.logprob[job.continuation[-1]]
                greedy = greedy and inner_greedy and last.argmax == job.continuation[-1]
            out.append((ll, bool(greedy)))
        return out

    def _score_on_engine(self, jobs: list[ScoreRequest]) -> list[tuple[float, bool]]:
        """`score` through the serving engine (an engine bundle's kernels, tensor-parallel ranks), with the same
        left-truncation to max_length."""
        pairs = []
        for job in jobs:
            keep = max(1, self.max_length + 1 - self._checked_length(job))
            pairs.append((job.context[-keep:], job.continuation))
        return self.engine().loglikelihood(pairs)

    def _checked_length(self, job: ScoreRequest) -> int:
        """The continuation's length; a job that cannot be scored raises."""
        if not job.context or not job.continuation:
            raise ValueError("loglikelihood needs a non-empty context and continuation")
        n = len(job.continuation)
        if n > self.max_length:
            raise UserError(f"a continuation of {n} tokens exceeds max_length {self.max_length}")
        return n

    def _padded(self, seqs: list[tuple[int, ...]], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ids [B, T] and their positions (row r starts at starts[r])."""
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.tokenizer.eos_token_id or 0, dtype=torch.long, device=self.device)
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
        pos = torch.arange(width, device=self.device)[None] + torch.tensor(starts, device=self.device)[:, None]
        return ids, pos

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole documents, cut into disjoint windows of max_length tokens
        (the first conditioned on the prefix token), as lm-eval's perplexity tasks expect."""
        windows: list[tuple[int, ScoreRequest]] = []
        for idx, req in enumerate(requests):
            (text,) = req.args
            for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((idx, ScoreRequest(ctx, cont)))
        scores = self.score([w for _, w in windows], progress=self.progress and not disable_tqdm)
        totals = [0.0] * len(requests)
        for (idx, _), (ll, _) in zip(windows, scores, strict=True):
            totals[idx] += ll
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---- generation -----------------------------------------------------------------------
    def engine(self) -> Any:
        """The serving engine over this same model (built on first use), with `serve`'s block size
        and step budget unless an engine config was given."""
        if self._engine is None:
            from lmfoundry.runtime.engine.engine_config import EngineConfig, default_step_tokens
            from lmfoundry.runtime.engine.llm_engine import LLMEngine

            config = self._engine_config or EngineConfig(
                block_size=cast("KernelModel", self.model).block_size if self.kernel_model else EngineConfig.block_size,
                max_num_batched_tokens=default_step_tokens(str(self.device)), deterministic=self.deterministic)
            self._engine = LLMEngine(self.model, self.tokenizer, config)
        return self._engine

    def next_token_logits(self, batch: torch.Tensor) -> torch.Tensor:
        """float32 logits [B, T - 1, vocab] of windows [B, T] through the serving engine, row j
        predicting token j + 1 of its window (`perplexity` takes this in place of a forward)."""
        rows = self.engine().prompt_logits(batch.tolist())
        # one window (eval-gate's perplexity): a view, not a copy of [T - 1, vocab] float32
        return rows[0].unsqueeze(0) if len(rows) == 1 else torch.stack(rows)

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy generation on the serving engine; stops at any `until` string or EOS; the
        stop string is cut from the text, as lm-eval expects."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

        from lmfoundry.runtime.engine.sampling_params import SamplingParams

        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        prompts, params, stops = [], [], []
        for req in requests:
            context, gen_kwargs = req.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            if kwargs.get("do_sample") and float(kwargs.get("temperature", 0.0)) > 0:
                raise UserError("eval-gate decodes greedily; a task asked for sampling (do_sample)")
            until = handle_stop_sequences(kwargs.get("until"), eos=eos_text)
            max_new = int(kwargs["max_gen_toks"])
            ids = self.tok_encode(context)[-(self.max_length - max_new):]
            prompts.append(ids)
            params.append(SamplingParams(max_tokens=max_new, temperature=0.0, stop=list(until),
                                         skip_special_tokens=True))
            stops.append(until)
        outs = self.engine().generate(prompts, params) if prompts else []
        texts = []
        for req, out, until in zip(requests, outs, stops, strict=True):
            text = out.outputs[0].text
            for s in until:
                if s and s in text:
                    text = text.split(s)[0]
            texts.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts
