"""The gate's scores hold for the server (slow tier): `lm_eval --model local-completions` against
`lmfoundry serve --deterministic` on the real default model scores a shipped eval-gate task
exactly as eval-gate's in-process model does in the same dtype, bfloat16 (the CPU default) and
float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import start_serve, stop_serve, wait_for_url

from lmfoundry.evals.lm_adapter import RuntimeLM
from lmfoundry.evals.lm_eval_runner import materialize_tasks
from lmfoundry.runtime.loader import load_model

from .test_echo_logprobs import run_task  # noqa: TID252

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
LIMIT = 24  # documents of the task (about 4 choices each)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_served_scores_equal_the_gate_s_to_1e_4_nats(tmp_path: Path, dtype: str) -> None:
    include, _ = materialize_tasks(tmp_path)
    model, tokenizer = load_model("smollm2-135m", dtype=getattr(torch, dtype))
    gate_lm = RuntimeLM(model, tokenizer, serving=True, deterministic=True, progress=False)
    ours, our_lls = run_task({"model": gate_lm, "limit": LIMIT}, "lmf_arc_easy", include)
    proc = start_serve(["smollm2-135m", "--deterministic", "--dtype", dtype, "--port", "0", "--max-model-len",
                        "2048", "--kv-cache-gb", "0.2"])
    try:
        url = wait_for_url(proc, timeout=600)
        args = {"model": "smollm2-135m", "base_url": f"{url}/completions", "num_concurrent": 2, "batch_size": 4}
        served, served_lls = run_task({"model": "local-completions", "model_args": args, "limit": LIMIT},
                                      "lmf_arc_easy", include)
    finally:
        stop_serve(proc)
    assert len(our_lls) == len(served_lls) == LIMIT
    worst = max(abs(a - b) for ours_doc, served_doc in zip(our_lls, served_lls, strict=True)
                for a, b in zip(ours_doc, served_doc, strict=True))
    assert worst <= 1e-4, worst
    for metric in ("acc,none", "acc_norm,none"):
        assert served[metric] == ours[metric], (metric, served, ours)
