"""One model's per-document results on a tier, cached: evaluated through the serving engine (lm-eval
tasks, perplexity windows with the next-token reference or the divergence from it, greedy
answers), or read back from `<cache>/eval-gate/` when the key matches.

The key is the sha256 of everything the results are a deterministic function of: the model's
files (`fingerprints.py`), the task files, the tier and prompt settings, the reference's digest
(a candidate), the dtype, device, degree and execution path, the library versions. A baseline's
next-token reference is cached beside its results.
"""

from __future__ import annotations

import gc
import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch

from lmfoundry.calibration.data import eval_token_stream, token_hash
from lmfoundry.checkpoint.sources import resolve_model
from lmfoundry.engine_bundle.engine_manifest import is_engine_bundle
from lmfoundry.evals.divergence import DivergenceScorer, Reference, ReferenceRecorder
from lmfoundry.evals.fingerprints import adapter_fingerprint, bundle_fingerprint, fingerprint
from lmfoundry.evals.gate_memory import Phases
from lmfoundry.evals.gate_spec import GateSpec, Tier
from lmfoundry.evals.generation import Prompt, generate, tier_prompts
from lmfoundry.evals.lm_adapter import RuntimeLM
from lmfoundry.evals.lm_eval_runner import run_lm_eval
from lmfoundry.evals.perplexity import perplexity
from lmfoundry.heap import release_free_heap
from lmfoundry.manifest import sha256_file, tool_versions
from lmfoundry.resources import cache_dir
from lmfoundry.runtime.engine.lora_adapters import attach_adapter
from lmfoundry.runtime.engine.ranks import ShardSpec, load_sharded
from lmfoundry.runtime.loader import load_model, resolve_dtype

SCHEMA_VERSION = 2
PPL_BATCH = 1  # perplexity windows per engine call (part of the cache key: batching changes rounding)


def _key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _cache_path(key: dict[str, Any]) -> Path:
    return cache_dir() / "eval-gate" / f"{_key_digest(key)}.json"


def _read_cached(cache: Path, key: dict[str, Any], ref_file: Path | None) -> dict[str, Any] | None:
    """The cached results for `key`, or None (a miss; a damaged or foreign entry is removed). The
    file's name is the key's digest, but a name proves nothing: a file copied or swapped under it
    (another model's results, a restored CI cache) would be served as this model's. So each entry
    records its key digest and its reference's sha256, and both are compared before use."""
    try:
        cached = json.loads(cache.read_text())
        if not isinstance(cached, dict) or cached.pop("cache_key", None) != _key_digest(key):
            raise ValueError("written for another key")
        ref_sha = cached.pop("reference_sha256", None)
        if ref_file is not None:
            if ref_sha != sha256_file(ref_file):
                raise ValueError("reference does not match")
            cached["reference"] = Reference.load(ref_file)
        return cached
    except (json.JSONDecodeError, OSError, ValueError, KeyError, UnicodeDecodeError):
        cache.unlink(missing_ok=True)
        return None


def evaluate_model(spec: str, tier: Tier, gate: GateSpec, include_paths: list[Path], task_hashes: dict[str, str],
                   use_cache: bool = True, progress: bool = False, device: str = "cpu", dtype: str = "auto",
                   reference: Reference | None = None, prompts: list[Prompt] | None = None, tp: int = 1,
                   deterministic: bool = False, lora: tuple[str, str] | None = None) -> dict[str, Any]:
    """Per-document results of one model on the tier (from the cache when the inputs match). An
    engine bundle runs its compiled kernels on `device` (what `serve` would run); a checkpoint runs
    in `dtype` (`auto`: what `serve` picks on this CPU), split over `tp` ranks as `serve --tp`
    runs it (its results are cached apart: the ranks' partial sums round differently); everything
    goes through the serving engine, batch-invariant with `deterministic` (`serve --deterministic`).

    Without `reference` the model is a baseline: its next-token distributions on the perplexity
    windows are kept (`data["reference"]`, cached beside the results). With one, the model is a
    candidate scored against it token by token (`data["divergence"]`), and the reference's digest
    is part of the cache key. With `lora` (name, PEFT folder), the model runs that adapter on every
    row (see the module doc)."""
    tasks, ppl, gen = tier.tasks, tier.perplexity, tier.generation
    bundle = is_engine_bundle(spec)
    run_dtype = resolve_dtype(dtype, spec, device)
    folder = Path(spec) if bundle else resolve_model(spec)
    fp = bundle_fingerprint(folder) if bundle else fingerprint(folder)
    if gen is not None and prompts is None:
        prompts = tier_prompts(gen)
    adapter = None if lora is None else {"name": lora[0], "path": lora[1], "sha256": adapter_fingerprint(lora[1])["sha256"]}
    key = {"schema": SCHEMA_VERSION, "model": fp["sha256"], "versions": tool_versions(),
           "tasks": [[t.name, t.limit, task_hashes.get(t.name)] for t in tasks],
           "ppl": None if ppl is None else [ppl.text, ppl.ctx, ppl.windows, ppl.top_k, PPL_BATCH],
           "reference": None if reference is None else reference.digest(),
           "generation": None if gen is None else [gen.max_tokens, [p.__dict__ for p in prompts or []]],
           "prompt": [gate.add_bos, gate.chat_template, gate.num_fewshot], "seed": gate.seed,
           "threads": torch.get_num_threads(), **({"device": device} if bundle else {}),
           **({"dtype": str(run_dtype)} if run_dtype is not None else {}), **({"tp": tp} if tp > 1 else {}),
           "execution": {"path": "serving engine", "deterministic": deterministic},
           **({"lora": adapter["sha256"]} if adapter is not None else {})}
    cache = _cache_path(key)
    keeps_reference = ppl is not None and reference is None
    ref_file = cache.with_name(cache.stem + ".reference.npz")
    if use_cache and cache.exists() and (ref_file.exists() or not keeps_reference):
        cached = _read_cached(cache, key, ref_file if keeps_reference else None)
        if cached is not None:
            # the cached numbers belong to these exact files, wherever they were found then
            cached.update(spec=spec, path=str(folder), from_cache=str(cache))
            return cached

    phases = Phases()
    phases.mark("start")
    t0, cpu0 = time.time(), time.process_time()
    if tp > 1:
        model, tokenizer = load_sharded(ShardSpec.on(str(folder), run_dtype, tp, max(1, torch.get_num_threads() // tp),
                                                     device))
    else:
        model, tokenizer = load_model(folder, dtype=run_dtype, device=device)
    lm = RuntimeLM(model, tokenizer, add_bos=gate.add_bos, serving=True, deterministic=deterministic,
                   progress=progress)
    if lora is not None:
        # the engine's executor first: its serving swap (prepacked, fused q/k/v) is the model the adapter wraps
        attach_adapter(lm.engine().runner.executor, model.config, lora[1])
    data: dict[str, Any] = {"spec": spec, "path": str(folder), "fingerprint": fp, "dtype": str(model.dtype),
                            "execution": lm.execution(),
                            **({"lora": adapter} if adapter is not None else {}),
                            "prompt": {**lm.prompt_settings(), "chat_template": gate.chat_template,
                                       "num_fewshot": gate.num_fewshot},
                            "threads": torch.get_num_threads()}
    phases.mark("loaded")
    t1 = time.time()
    data["tasks"] = run_lm_eval(lm, tasks, gate, include_paths, progress=progress)
    phases.mark("tasks")
    t2 = time.time()
    recorder: ReferenceRecorder | None = None
    scorer: DivergenceScorer | None = None
    if ppl is not None:
        stream, source, digest = eval_token_stream(ppl.text, tokenizer)
        observe: Callable[[torch.Tensor, torch.Tensor], None]
        if reference is None:
            observe = recorder = ReferenceRecorder(ppl.top_k)
        else:
            observe = scorer = DivergenceScorer(reference)
        # one window at a time: its float32 logits over a 128k-152k vocabulary are a third of a GB
        res = perplexity(lm, stream, ctx=ppl.ctx, max_windows=ppl.windows, batch_size=PPL_BATCH, progress=progress,
                         observe=observe)
        used = stream[: res.windows * ppl.ctx]
        data["perplexity"] = {"source": source, "source_sha256": digest, "token_sha256": token_hash(used),
                              "ctx": ppl.ctx, "windows": res.windows, "ppl": res.ppl,
                              "window_nll": res.window_nll, "window_tokens": [ppl.ctx - 1] * res.windows}
        if scorer is not None:
            data["divergence"] = scorer.statistics().to_lists()
        phases.mark("perplexity")
    t3 = time.time()
    if gen is not None and prompts is not None:
        data["generation"] = generate(lm, prompts, gen.max_tokens)
        phases.mark("generation")
    data["seconds"] = {"load": round(t1 - t0, 2), "tasks": round(t2 - t1, 2), "perplexity": round(t3 - t2, 2),
                       "generation": round(time.time() - t3, 2),
                       "cpu": round(time.process_time() - cpu0, 2)}  # this process's CPU seconds, all threads
    if tp > 1:
        model.close()  # the worker ranks' CPU time is not in "cpu" above
    del model, lm
    gc.collect()  # the next model (an 8B candidate after its baseline) must find this one's memory free
    # glibc keeps freed heap pages mapped for reuse; the candidate's weights would then be counted
    # on top of the baseline's in resident memory even though the baseline is gone
    release_free_heap()
    phases.mark("freed")
    data["memory"] = phases.rows
    kept = None if recorder is None else recorder.reference()
    if use_cache:
        cache.parent.mkdir(parents=True, exist_ok=True)
        entry = {**data, "cache_key": _key_digest(key)}
        if kept is not None:
            kept.save(ref_file)
            entry["reference_sha256"] = sha256_file(ref_file)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps(entry))
        tmp.replace(cache)
    if kept is not None:
        data["reference"] = kept
    data["from_cache"] = None
    return data
