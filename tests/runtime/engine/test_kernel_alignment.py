"""Every kernel call the serving runtime makes could run from a shipped cubin: zero JIT on a GPU.

A lent H200 ran 48 of 515 kernel calls of a W4A16 bundle through Triton JIT: the cubins were built
assuming 16-byte aligned pointers (and `aligned` integers divisible by 16), and the runtime handed
rotary, store_kv and the attention kernels slices of one packed metadata tensor at 4-byte offsets.
No GPU is needed to see that: the bundle is compiled here, the engine runs it on CPU with each
kernel's PyTorch reference, and every call first goes through the launcher's own decision
(`CubinLauncher.find` + `ShippedKernel.assumptions_hold`, reading each kernel's JSON): a call no
cubin covers, or one that breaks a divisibility its cubin was built with, would have been JIT.

Driven: prompts of many lengths with shared prefixes (prefix-cache hits), prefill chunked by a
small token budget and mixed with decodes, batches growing from 1 to 64 sequences and draining
back, contexts long enough for split decode attention, and every decode-only step also through
the CUDA-graph buffers of its batch bucket.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import tiny_model_folder, write_text

from lmfoundry.cli import main
from lmfoundry.compile.bundle import build_engine
from lmfoundry.kernels import tiles
from lmfoundry.kernels.dispatch import ReferenceLauncher
from lmfoundry.kernels.spec import KernelCall
from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from lmfoundry.runtime.engine.kernel_executor import GRAPH_BUCKETS, graph_inputs, graph_views
from lmfoundry.runtime.kernel_model import KernelModel
from lmfoundry.runtime.kernel_set import CubinLauncher, divisibility
from lmfoundry.runtime.loader import load_bundle

SCHEMES = {
    "w4a16": ["--scheme", "w4a16", "--group-size", "32"],
    "fp8": ["--method", "fp8", "--scheme", "fp8-dynamic"],
}


class CubinDecision:
    """A launcher that asks the cubin launcher what it would do with each call (without a GPU),
    records every call it would not run from a cubin, then runs the call's reference."""

    def __init__(self, engine: Path, manifest: dict) -> None:
        entries = [e for e in manifest["kernels"] if e["capability"] == 90]
        self.cubins = CubinLauncher(engine, entries, 0, ReferenceLauncher())
        self.stats: Counter = Counter()
        self.jit: list[str] = []
        self.checked = Counter()  # (kernel, param) -> calls whose value met a divisibility > 1

    def run(self, call: KernelCall) -> None:
        kernel = self.cubins.find(call)
        reason = "no shipped kernel covers it" if kernel is None else kernel.assumptions_hold(call)
        if reason is None:
            assert kernel is not None
            self.stats["cubin"] += 1
            for p in kernel.meta["params"]:
                if divisibility(p) > 1:
                    self.checked[(call.kernel.name, p["name"])] += 1
        else:
            self.stats["jit"] += 1
            self.jit.append(f"{call.kernel.name} {call.shape}: {reason}")
        call.kernel.reference(call)


def bundle(root: Path, scheme: str) -> Path:
    model = tiny_model_folder(root / "tiny", "llama", head_dim=64, torch_dtype="bfloat16")
    ckpt = root / scheme
    main(["quantize", str(model), "-o", str(ckpt), "--quiet", "--num-samples", "2", "--seq-len", "32",
          "--calib", str(write_text(root / "calib.txt")), *SCHEMES[scheme]])
    return build_engine(ckpt, ["hopper"], root / f"{scheme}-engine", progress=False).output


def as_on_a_gpu(obj: Any) -> Any:
    """The loaded weights, each copied into memory of its own: what `.to("cuda")` makes of every
    weight on a GPU. On CPU they are views into the safetensors file, at whatever offset the file
    gave them, which no GPU run ever passes to a kernel."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, (list, tuple)):
        return type(obj)(as_on_a_gpu(x) for x in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            if f.name not in ("config", "kernels", "share", "comm"):
                setattr(obj, f.name, as_on_a_gpu(getattr(obj, f.name)))
    return obj


def graph_steps(executor, decision: CubinDecision) -> list[int]:
    """Wrap `executor.forward` so that each decode-only step also runs through the CUDA-graph
    layout of its bucket (the buffers `DecodeGraphs` captures and replays); returns the buckets seen."""
    eager = executor.forward
    buckets: list[int] = []

    def forward(step):
        hidden = eager(step)
        b = len(step.items)
        if step.num_decode == b and b <= GRAPH_BUCKETS[-1]:
            bucket = next(x for x in GRAPH_BUCKETS if x >= b)
            width = max(-(-(c + 1) // step.block_size) for c, _, _ in step.items) + 1
            ids, pos, attn = graph_views(graph_inputs(step, bucket, width), bucket, width)
            graphed = executor.model.hidden_states(ids, pos, attn, executor.caches)[:b]
            torch.testing.assert_close(graphed, hidden, rtol=0, atol=0)  # padding rows change nothing
            buckets.append(bucket)
        return hidden

    executor.forward = forward
    return buckets


def run_engine(engine_dir: Path) -> tuple[CubinDecision, list[int]]:
    kmodel, _ = load_bundle(engine_dir, "cpu", interpret=False)
    assert isinstance(kmodel, KernelModel)
    as_on_a_gpu(kmodel)
    decision = CubinDecision(engine_dir, kmodel.kernels.manifest)
    kmodel.kernels.launcher = decision
    # FlashDecoding splits as on the GPU the bundle targets (split + merge kernels), not CPU's one
    kmodel.decode_sm_count = lambda: tiles.nominal_sm_count(90)
    engine = LLMEngine(kmodel, None, EngineConfig(block_size=kmodel.block_size, num_kv_blocks=512,
                                                  max_num_seqs=64, max_num_batched_tokens=96))
    buckets = graph_steps(engine.runner.executor, decision)
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 250, (40,), generator=gen).tolist()
    # waves: the running batch grows 1, 2, 3; two long contexts (over 2 x MIN_SPLIT_TOKENS: decode
    # splits the context and merges the splits) prefill in chunks; then 64 short prompts decode
    # together and drain by halves (32 stop after 8 tokens, 16 after 10, ..., the last after 20)
    waves = [[3], [5, 17], [1, 30, 33], [300, 280], [1 + i % 4 for i in range(64)]]
    for w, lengths in enumerate(waves):
        for i, n in enumerate(lengths):
            prefix = shared[: 16 + i % 24] if i % (8 if len(lengths) == 64 else 3) == 0 else []
            prompt = prefix + torch.randint(3, 250, (n,), generator=gen).tolist()
            tokens = 8 + 2 * (6 - (63 - i).bit_length()) if len(lengths) == 64 else 2 + i % 11
            engine.add_request(f"w{w}-{i}", prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    return decision, buckets


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("alignment")
    return {scheme: root / scheme for scheme in SCHEMES}


@pytest.mark.parametrize("scheme", [pytest.param("w4a16"), pytest.param("fp8", marks=pytest.mark.slow)])
def test_every_call_could_run_from_a_shipped_cubin(engines, scheme):
    engine_dir = bundle(engines[scheme], scheme)
    decision, buckets = run_engine(engine_dir)
    assert decision.jit == [], "\n".join(sorted(set(decision.jit))[:20])
    assert decision.stats["cubin"] > 1000
    # the metadata the lease saw at 4-byte offsets was checked, every time, against the JSON's value
    for kernel, param in [("rotary", "pos_ptr"), ("store_kv", "slot_ptr"), ("paged_prefill", "block_table_ptr"),
                          ("paged_prefill", "cu_q_ptr"), ("paged_prefill", "ctx_len_ptr"),
                          ("paged_decode_split", "block_table_ptr"), ("paged_decode_split", "ctx_len_ptr"),
                          ("paged_decode_reduce", "out_ptr")]:
        assert decision.checked[(kernel, param)] > 0, (kernel, param)
    assert set(buckets) == {b for b in GRAPH_BUCKETS if b <= 64}, sorted(set(buckets))
