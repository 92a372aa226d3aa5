"""`echo` with prompt logprobs on /v1/completions (OpenAI's legacy format), and
`lm_eval --model local-completions` against the server scoring what our in-process evaluation
scores."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest
import torch
from helpers import QUESTIONS, write_task
from toy import byte_tokenizer, save_toy_checkpoint, toy_model

from lmfoundry.runtime.engine import AsyncLLMEngine, EngineConfig, LLMEngine
from lmfoundry.runtime.server.app import create_app
from lmfoundry.runtime.server.background import serve_in_thread

from .test_server import assert_healthy

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def reference():
    """The weights of the conftest server's model (toy_model(seed=2)), run as a plain forward."""
    return toy_model(seed=2)


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab] float64 log-softmax: row p scores token p + 1 (full recompute)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0, :-1].double(), dim=-1)


def completion(url: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def check_echo(choice: dict, ids: list[int], model, top: int, generated: int) -> None:
    """A choice of an echo request against the reference: OpenAI's legacy logprobs layout."""
    lp = choice["logprobs"]
    tok = byte_tokenizer()
    n = len(ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    assert len(lp["tokens"]) == n + generated
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"][:n] == [tok.decode([t]) for t in ids]
    ref = reference_logprobs(model, ids)
    want = [float(ref[p - 1, ids[p]]) for p in range(1, n)]
    got = lp["token_logprobs"][1:n]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4, (got, want)
    for p in range(1, n):
        # the `top` most likely tokens by text (the first, most likely, of tokens sharing a text,
        # e.g. byte tokens that decode to U+FFFD) plus the chosen token
        best = ref[p - 1].topk(top)
        want_top: dict[str, float] = {}
        for token, value in zip(best.indices.tolist(), best.values.tolist(), strict=True):
            want_top.setdefault(tok.decode([token]), value)
        want_top.setdefault(lp["tokens"][p], want[p - 1])
        entry = lp["top_logprobs"][p]
        assert entry.keys() == want_top.keys()
        assert max(abs(entry[k] - want_top[k]) for k in entry) < 1e-4
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and all(offsets[i + 1] == offsets[i] + len(lp["tokens"][i]) for i in range(len(offsets) - 1))


def test_echo_scores_the_prompt_like_the_reference(server, reference) -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (40,), generator=g).tolist()
    body = completion(server.url, prompt=ids, max_tokens=0, echo=True, logprobs=3, temperature=0)
    choice = body["choices"][0]
    check_echo(choice, ids, reference, top=3, generated=0)
    assert choice["finish_reason"] == "length" and choice["text"] == byte_tokenizer().decode(ids)
    assert body["usage"] == {"prompt_tokens": 40, "completion_tokens": 0, "total_tokens": 40}

    # lm-eval's request: echo, logprobs 1, max_tokens 1: the prompt's entries, then the generated token's
    body = completion(server.url, prompt=[ids], max_tokens=1, echo=True, logprobs=1, temperature=0, seed=1234)
    check_echo(body["choices"][0], ids, reference, top=1, generated=1)
    assert body["usage"]["completion_tokens"] == 1


def test_echo_with_text_prompts_batches_and_streaming(server, reference) -> None:
    tok = byte_tokenizer()
    prompts = ["The quick brown fox", "héllo wörld, naïve"]
    body = completion(server.url, prompt=prompts, max_tokens=0, echo=True, logprobs=2)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for prompt, choice in zip(prompts, body["choices"], strict=True):
        assert choice["text"] == prompt
        check_echo(choice, tok(prompt).input_ids, reference, top=2, generated=0)
    # streamed: the same entries, in chunks
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
            "prompt": prompts[0], "max_tokens": 3, "echo": True, "logprobs": 2, "temperature": 0,
            "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = {k: [v for c in chunks for v in c["choices"][0]["logprobs"][k]] for k in ("tokens", "token_logprobs")}
    whole = completion(server.url, prompt=prompts[0], max_tokens=3, echo=True, logprobs=2, temperature=0)
    assert streamed == {k: whole["choices"][0]["logprobs"][k] for k in ("tokens", "token_logprobs")}
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


def test_echo_with_chunked_prefill_and_a_warm_prefix_cache(make_server, reference) -> None:
    """A prompt whose blocks are already in the prefix cache still gets every prompt logprob,
    computed in chunks of 8 tokens."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (45,), generator=g).tolist()
    with make_server(max_num_batched_tokens=8) as live:
        completion(live.url, prompt=ids, max_tokens=2, temperature=0)  # puts the prompt's blocks in the cache
        hits = live.engine.stats()["prefix_cache_hits_tokens"]
        completion(live.url, prompt=ids, max_tokens=2, temperature=0)
        assert live.engine.stats()["prefix_cache_hits_tokens"] > hits  # the cache does serve this prompt
        body = completion(live.url, prompt=ids, max_tokens=0, echo=True, logprobs=2)
        check_echo(body["choices"][0], ids, reference, top=2, generated=0)
        body = completion(live.url, prompt=ids, max_tokens=2, echo=True, logprobs=0, n=2, temperature=0)
        for choice in body["choices"]:
            check_echo(choice, ids, reference, top=0, generated=2)
        assert live.engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0, "logprobs": 1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
    ({"prompt": "x", "max_tokens": -1, "echo": True}, None),
])
def test_max_tokens_zero_needs_echo(server, body: dict, param: str | None) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and (param or "max_tokens") in err["message"], err
    assert_healthy(server.url)


# ---- lm-eval local-completions against a started server ------------------------------------------
def run_task(model, task: str, include: Path) -> tuple[dict, list[list[float]]]:
    """lm-eval's results for the task and each document's per-choice loglikelihoods."""
    import lm_eval.models  # noqa: F401 - registers local-completions (lm-eval only does so on an empty registry)
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    res = simple_evaluate(**model, tasks=[task], task_manager=TaskManager(include_path=[str(include)],
                                                                         include_defaults=False),
                          log_samples=True, bootstrap_iters=0, random_seed=0, numpy_random_seed=0,
                          torch_random_seed=0, fewshot_random_seed=0)
    rows = sorted(res["samples"][task], key=lambda r: r["doc_id"])
    return res["results"][task], [[float(x[0]) for x in r["filtered_resps"]] for r in rows]


def test_tokenizer_endpoints(server) -> None:
    """vLLM's /tokenizer_info, /tokenize, /detokenize: what lm-eval's remote tokenizer calls."""
    tok = byte_tokenizer()
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == 256 and info["chat_template"]
    text = "héllo <|im_end|>"
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert r["tokens"] == tok(text, add_special_tokens=False).input_ids and r["count"] == len(r["tokens"])
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": text}
    for path, body in (("/tokenize", {"prompt": 5}), ("/detokenize", {"tokens": [99999]}),
                       ("/detokenize", {"tokens": "abc"})):
        assert httpx.post(f"{server.url}{path}", json=body).status_code == 400
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "x", "model": "gpt-9"}).status_code == 404


@pytest.mark.parametrize("backend", ["auto", "huggingface"])
def test_lm_eval_local_completions_matches_in_process_evaluation(tmp_path: Path, backend: str) -> None:
    """`lm_eval --model local-completions` as is: with only base_url and model it finds the
    server's tokenizer endpoints ("auto" -> remote); or with a local tokenizer folder."""
    from lmfoundry.evals.lm_adapter import RuntimeLM
    from lmfoundry.runtime.loader import load_model

    folder = save_toy_checkpoint(tmp_path / "toy", seed=2)
    task = write_task(tmp_path / "tasks")
    model, tokenizer = load_model(str(folder))
    ours, our_lls = run_task({"model": RuntimeLM(model, tokenizer)}, task, tmp_path / "tasks")

    config = EngineConfig(num_kv_blocks=128, block_size=8, max_model_len=512, max_num_batched_tokens=64)
    engine = AsyncLLMEngine(LLMEngine(model, tokenizer, config))
    try:
        app = create_app(engine, "toy")
        tokenized: list[bytes] = []
        real_tokenize = app.state.server._tokenize
        app.state.server._tokenize = lambda body: (tokenized.append(body), real_tokenize(body))[1]
        with serve_in_thread(app) as url:
            args = {"model": "toy", "base_url": f"{url}/v1/completions"}
            if backend == "huggingface":
                args.update(tokenizer=str(folder), tokenizer_backend="huggingface")
            else:  # and lm-eval's other request path: concurrent (aiohttp), several prompts per request
                args.update(num_concurrent=2, batch_size=3)
            served, served_lls = run_task({"model": "local-completions", "model_args": args}, task,
                                          tmp_path / "tasks")
            assert engine.engine.num_requests_total == sum(len(c) for _, c, _ in QUESTIONS)
            assert bool(tokenized) == (backend == "auto")  # "auto" found and used the server's tokenizer
    finally:
        engine.shutdown()

    assert len(our_lls) == len(served_lls) == len(QUESTIONS)
    for ours_doc, served_doc in zip(our_lls, served_lls, strict=True):
        assert all(math.isfinite(x) and x < 0 for x in ours_doc)
        assert max(abs(a - b) for a, b in zip(ours_doc, served_doc, strict=True)) < 1e-3, (ours_doc, served_doc)
    for metric in ("acc,none", "acc_norm,none"):
        assert served[metric] == ours[metric], (metric, served, ours)
    assert 0 < ours["acc,none"] < 1  # a mix of right and wrong answers: the comparison has teeth


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_deterministic_served_scores_equal_the_gate_s_in_process_scores(tmp_path: Path, dtype) -> None:
    """eval-gate's in-process scoring (`RuntimeLM` on the serving engine, deterministic) and
    `lm_eval --model local-completions` against a deterministic server on the same weights and
    dtype agree to 1e-4 nats per request (bit for bit, in fact), though the server runs other
    block sizes and step budgets and lm-eval sends several prompts per request, concurrently."""
    from lmfoundry.evals.lm_adapter import RuntimeLM

    def model() -> torch.nn.Module:  # heads of 64: the attention kernel's bf16 dot-product path
        return toy_model(seed=2, dtype=dtype, hidden_size=256, intermediate_size=512)

    task = write_task(tmp_path / "tasks")
    gate_lm = RuntimeLM(model(), byte_tokenizer(), serving=True, deterministic=True, progress=False)
    assert gate_lm.execution() == {"path": "serving engine", "dtype": str(dtype).removeprefix("torch."),
                                   "deterministic": True}
    ours, our_lls = run_task({"model": gate_lm}, task, tmp_path / "tasks")
    config = EngineConfig(num_kv_blocks=128, block_size=8, max_model_len=512, max_num_batched_tokens=48,
                          deterministic=True)
    engine = AsyncLLMEngine(LLMEngine(model(), byte_tokenizer(), config))
    try:
        with serve_in_thread(create_app(engine, "toy")) as url:
            args = {"model": "toy", "base_url": f"{url}/v1/completions", "num_concurrent": 2, "batch_size": 3}
            served, served_lls = run_task({"model": "local-completions", "model_args": args}, task,
                                          tmp_path / "tasks")
    finally:
        engine.shutdown()
    assert len(our_lls) == len(served_lls) == len(QUESTIONS)
    worst = max(abs(a - b) for ours_doc, served_doc in zip(our_lls, served_lls, strict=True)
                for a, b in zip(ours_doc, served_doc, strict=True))
    assert worst <= 1e-4, (our_lls, served_lls)
    assert our_lls == served_lls  # the same float64 sums of the same float32 logprobs
    for metric in ("acc,none", "acc_norm,none"):
        assert served[metric] == ours[metric], (metric, served, ours)
