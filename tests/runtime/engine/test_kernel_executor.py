"""The kernel executor: a tiny model quantized (W4A16, W8A8, FP8, W4A16 + FP8 / INT8 KV), compiled
into an engine bundle, and run through the bundle's kernels.

Two comparisons, each with a bound derived from the arithmetic:
- kernel executor vs the PyTorch reference executor (today's CPU path: the reference `CausalLM`,
  dequantized W4A16, its own KV cache). The two round at different points (the fused RMSNorm +
  quantization keeps fp32 in registers, rotary runs in fp32, the paged kernels fold KV scales into
  the softmax): teacher-forced on the same tokens, every log-probability agrees within
  2·K·u·max_v Σ_j |h_j||W_vj| (first-order effect on a logit of a relative perturbation K·u of the
  final hidden state h; K = 6 differently rounded intermediates per layer + 2, u = 2^-8 for bf16),
  and the greedy choice agrees wherever the reference's top-2 margin exceeds that bound.
- Triton kernels (the interpreter on CPU, a GPU in the `gpu` test) vs the same executor on each
  kernel's PyTorch reference: same rounding points, so 16 greedy tokens on 3 prompts agree, but for
  a reference near-tie (top-2 gap within the same bound) that fp32 summation order can tip.
Measured on these models: max |Δ logprob| / bound 0.03 (W4A16) to 0.16 (FP8) against the reference
executor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import tiny_model_folder, wait_for_url, write_text

from lmfoundry.cli import main
from lmfoundry.compile.bundle import build_engine
from lmfoundry.engine_bundle.engine_manifest import EngineIntegrityError
from lmfoundry.kernels.dispatch import is_interpreter
from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from lmfoundry.runtime.loader import load_bundle, load_model

SCHEMES = {
    "w4a16": ["--scheme", "w4a16", "--group-size", "32"],
    "w8a8": ["--method", "smoothquant", "--scheme", "w8a8"],
    "fp8": ["--method", "fp8", "--scheme", "fp8-dynamic"],
    "w4a16-kv-fp8": ["--scheme", "w4a16", "--group-size", "32", "--kv-cache", "fp8"],
    "w4a16-kv-int8": ["--scheme", "w4a16", "--group-size", "32", "--kv-cache", "int8"],
    # GPTQ act-order with g_idx: K permuted at compile time, down_proj's folded into gate/up's rows
    "w4a16-actorder": ["--method", "gptq", "--scheme", "w4a16", "--group-size", "32", "--actorder", "dynamic"],
}
PROMPTS = [[1, 5, 9, 33, 70, 8], [1, 40, 41, 42], [1, *range(100, 130)]]
U_BF16 = 2.0**-8


class Bundles:
    """Quantized checkpoints and their hopper bundles, built once per module on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.model = tiny_model_folder(root / "tiny", "llama", head_dim=64, torch_dtype="bfloat16")
        self.calib = write_text(root / "calib.txt")

    def checkpoint(self, scheme: str) -> Path:
        out = self.root / scheme
        if not (out / "config.json").exists():
            main(["quantize", str(self.model), "-o", str(out), "--quiet", "--num-samples", "2", "--seq-len", "32",
                  "--calib", str(self.calib), *SCHEMES[scheme]])
        return out

    def engine(self, scheme: str) -> Path:
        out = self.root / f"{scheme}-engine"
        if not (out / "engine.json").exists():
            build_engine(self.checkpoint(scheme), ["hopper"], out, progress=False)
        return out


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> Bundles:
    return Bundles(tmp_path_factory.mktemp("kernel-executor"))


def _engine(model, tokenizer) -> LLMEngine:
    return LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=64))


def teacher_forced(engine: LLMEngine, ids: list[int]) -> list:
    """Prompt log-probabilities (top 2) of every position of `ids` (prefill through the engine)."""
    out = engine.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    return out.prompt_logprobs[1:]


def logit_bound(ref_model, ids: list[int]) -> torch.Tensor:
    """Per position: 2 K u max_v sum_j |h_j| |W_vj| (see the module docstring)."""
    with torch.no_grad():
        h = ref_model.hidden_states(torch.tensor([ids]))[0].float()
    w = ref_model.lm_head.weight.float()
    k = 6 * ref_model.config.num_layers + 2
    return 2 * k * U_BF16 * (h.abs() @ w.abs().t()).amax(dim=-1)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_kernel_executor_agrees_with_the_reference_executor(bundles: Bundles, scheme: str) -> None:
    ref_model, tok = load_model(bundles.checkpoint(scheme), dtype=torch.bfloat16)
    kmodel, _ = load_bundle(bundles.engine(scheme), "cpu", interpret=False)
    reference, kernels = _engine(ref_model, tok), _engine(kmodel, tok)
    for prompt in PROMPTS:
        greedy = reference.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].token_ids
        ids = prompt + greedy
        bound = logit_bound(ref_model, ids)
        ref_lp, ker_lp = teacher_forced(reference, ids), teacher_forced(kernels, ids)
        assert len(ref_lp) == len(ker_lp) == len(ids) - 1
        for pos, (r, k) in enumerate(zip(ref_lp, ker_lp, strict=True)):
            b = float(bound[pos])
            assert abs(r.logprob - k.logprob) <= b, (scheme, pos, r.logprob, k.logprob, b)
            margin = r.top[0][1] - r.top[1][1]
            if margin > b:
                assert k.top[0][0] == r.top[0][0], (scheme, pos, r.top, k.top, b)
    # the executor ran the bundle's ops, not the reference model
    assert kmodel.kernels.mode == "reference" and kmodel.kernels.stats["reference"] > 0
    # and says so (what serve prints and /v1/models exports): the bundle's schemes, its kernels
    schemes = {r["scheme"] for name, r in kmodel.kernels.manifest["linears"].items() if name != "lm_head"}
    assert kernels.info.weight_format.split("; ")[0].split(" (")[0] in schemes
    assert kernels.info.weight_format.endswith("(engine bundle: PyTorch kernel references)")
    assert reference.info.dtype == kernels.info.dtype == "bfloat16"


@pytest.mark.slow
@pytest.mark.parametrize("arch,overrides", [("qwen2", {"num_attention_heads": 2, "num_key_value_heads": 1}),
                                            ("qwen3", {"head_dim": 64})])
def test_qwen_families_through_the_kernels(bundles: Bundles, arch: str, overrides: dict) -> None:
    """q/k/v bias (Qwen2, fused into the qkv GEMM) and per-head q/k RMSNorm (Qwen3, planned by
    compile at head_dim) through the kernel executor, against the reference executor."""
    model = tiny_model_folder(bundles.root / arch, arch, torch_dtype="bfloat16", **overrides)
    ckpt, engine = bundles.root / f"{arch}-w4a16", bundles.root / f"{arch}-w4a16-engine"
    main(["quantize", str(model), "-o", str(ckpt), "--quiet", "--num-samples", "2", "--seq-len", "32",
          "--calib", str(bundles.calib), *SCHEMES["w4a16"]])
    build_engine(ckpt, ["hopper"], engine, progress=False)
    if arch == "qwen3":
        manifest = json.loads((engine / "engine.json").read_text())
        norms = [c for k in manifest["kernels"] if k["kernel"] == "rmsnorm_quant" for c in k["covers"]]
        assert any(c["shape"] == {"H": 64} and "self_attn.qk_norm" in c["used_by"] for c in norms)
    ref_model, tok = load_model(ckpt, dtype=torch.bfloat16)
    kmodel, _ = load_bundle(engine, "cpu", interpret=False)
    reference, kernels = _engine(ref_model, tok), _engine(kmodel, tok)
    for prompt in PROMPTS:
        ids = prompt + reference.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].token_ids
        bound = logit_bound(ref_model, ids)
        for pos, (r, k) in enumerate(zip(teacher_forced(reference, ids), teacher_forced(kernels, ids), strict=True)):
            assert abs(r.logprob - k.logprob) <= float(bound[pos]), (arch, pos, r.logprob, k.logprob)


def check_triton_matches_references(bundles: Bundles, scheme: str, device: str, tokens: int) -> None:
    """Greedy decoding through the Triton kernels equals decoding through their references; where
    fp32 accumulation order moves a bf16 rounding (threads, tiles), a different token is allowed
    only at a reference near-tie (top-2 gap within the logit bound), and the log-probabilities of
    the tokens both chose agree within it."""
    ref_model, tok = load_bundle(bundles.engine(scheme), "cpu", interpret=False)
    triton_model, _ = load_bundle(bundles.engine(scheme), device)
    assert triton_model.kernels.mode in ("interpret", "cubin", "jit")
    params = SamplingParams(max_tokens=tokens, temperature=0, logprobs=2)
    expected = _engine(ref_model, tok).generate(PROMPTS, params)
    got = _engine(triton_model, tok).generate(PROMPTS, params)
    checkpoint_model, _ = load_model(bundles.checkpoint(scheme), dtype=torch.bfloat16)
    same = 0
    for prompt, e, g in zip(PROMPTS, expected, got, strict=True):
        e_out, g_out = e.outputs[0], g.outputs[0]
        bound = logit_bound(checkpoint_model, prompt + e_out.token_ids)
        for i, (a, b) in enumerate(zip(e_out.token_ids, g_out.token_ids, strict=True)):
            lp_e, lp_g, tol = e_out.logprobs[i], g_out.logprobs[i], float(bound[len(prompt) - 1 + i])
            if a != b:
                top = dict(lp_e.top)
                assert b in top and top[a] - top[b] <= tol, (scheme, i, lp_e.top, lp_g.top, tol)
                break
            assert abs(lp_e.logprob - lp_g.logprob) <= tol, (scheme, i, lp_e.logprob, lp_g.logprob, tol)
            same += 1
    assert same >= len(PROMPTS) * tokens // 2, same  # divergences are rare near-ties, not the rule
    stats = triton_model.kernels.stats
    if device != "cpu":
        assert stats.get("jit", 0) == 0 and stats["cubin"] > 0, stats  # every call from a shipped cubin


@pytest.mark.skipif(not is_interpreter(), reason="runs the Triton kernels through the interpreter")
def test_interpreted_kernels_match_their_references(bundles: Bundles) -> None:
    check_triton_matches_references(bundles, "w4a16-kv-int8", "cpu", tokens=3)


@pytest.mark.slow
@pytest.mark.heavy  # 16 tokens per scheme in the interpreter; the fast tier runs fewer
@pytest.mark.skipif(not is_interpreter(), reason="runs the Triton kernels through the interpreter")
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_interpreted_kernels_match_their_references_16_tokens(bundles: Bundles, scheme: str) -> None:
    check_triton_matches_references(bundles, scheme, "cpu", tokens=16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_cuda_kernels_match_their_references(bundles: Bundles, scheme: str) -> None:
    check_triton_matches_references(bundles, scheme, "cuda", tokens=16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decode_equals_eager_decode(bundles: Bundles) -> None:
    """Replaying the captured decode graphs runs the same kernels in the same order: same tokens."""
    model, tok = load_bundle(bundles.engine("w4a16-kv-fp8"), "cuda")
    params = SamplingParams(max_tokens=16, temperature=0)
    outs = []
    for graphs in (True, False):
        engine = LLMEngine(model, tok, EngineConfig(num_kv_blocks=64, cuda_graphs=graphs))
        outs.append([o.outputs[0].token_ids for o in engine.generate(PROMPTS, params)])
        if graphs:
            runner_graphs = engine.runner.executor.graphs
            assert runner_graphs is not None and runner_graphs.graphs and not runner_graphs.failed
    assert outs[0] == outs[1]


def test_w4a16_weights_stay_packed(bundles: Bundles) -> None:
    kmodel, _ = load_bundle(bundles.engine("w4a16"), "cpu", interpret=False)
    ref_model, _ = load_model(bundles.checkpoint("w4a16"), dtype=torch.bfloat16)
    layer = kmodel.layers[0]
    assert len(layer.qkv) == 1 and layer.qkv[0].tiled is not None  # fused and tiled, never dequantized
    assert layer.qkv[0].tiled.qweight.dtype == torch.int32 and layer.qkv[0].packed is None
    cfg = ref_model.config  # the decoder linears as dense bf16
    linears = 2 * cfg.num_layers * sum(n * k for n, k in cfg.linear_shapes.values())
    packed = sum(g.nbytes() for lw in kmodel.layers for g in (*lw.qkv, lw.o_proj, *lw.gate_up, lw.down))
    assert packed <= 0.3 * linears  # int4 codes + bf16 scales of g32: 0.25 + 1/32 of bf16


def test_act_order_bundle_permutes_k_at_compile_time(bundles: Bundles) -> None:
    """GPTQ act-order (g_idx) is resolved by compile: each GEMM's K is permuted so groups are
    contiguous, and down_proj's permutation lives in the rows of gate/up, so only q/k/v and o_proj
    gather their input at run time."""
    from lmfoundry.engine_bundle.weight_layout import ACT_ORDER_FOLD

    manifest = json.loads((bundles.engine("w4a16-actorder") / "engine.json").read_text())
    assert any(f["name"] == ACT_ORDER_FOLD and f["applied"] for f in manifest["fusions"])
    assert {k["kernel"] for k in manifest["kernels"] if k["kernel"].startswith("w4a16")} == {"w4a16_tiled"}
    kmodel, _ = load_bundle(bundles.engine("w4a16-actorder"), "cpu", interpret=False)
    for layer in kmodel.layers:
        down, gate_up, qkv = layer.down.tiled, layer.gate_up[0].tiled, layer.qkv[0].tiled
        assert down.perm is not None and down.input_permuted
        assert torch.equal(gate_up.out_perm[: down.in_features], down.perm)
        assert qkv.perm is not None and not qkv.input_permuted


def test_tampered_weights_are_refused(bundles: Bundles, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "engine"
    shutil.copytree(bundles.engine("w4a16"), copy)
    shard = copy / "weights" / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(EngineIntegrityError, match="sha256"):
        load_bundle(copy, "cpu")
    shutil.copy(bundles.engine("w4a16") / "weights" / "model.safetensors", shard)
    (copy / "weights" / "extra.safetensors").write_bytes(b"planted")
    with pytest.raises(EngineIntegrityError, match="not listed"):
        load_bundle(copy, "cpu")


def test_every_reader_refuses_a_tampered_kernel_file(bundles: Bundles, tmp_path: Path, capsys) -> None:
    """Issue 46: a bundle whose cubin was modified used to be served and evaluated on a CPU (where
    the kernels do not run), vouching for an artifact that is not the one compiled."""
    import shutil

    from helpers import run_cli

    copy = tmp_path / "engine"
    shutil.copytree(bundles.engine("w4a16"), copy)
    cubin = sorted((copy / "kernels").rglob("*.cubin"))[0]
    data = bytearray(cubin.read_bytes())
    data[100] ^= 0x01
    cubin.write_bytes(bytes(data))
    with pytest.raises(EngineIntegrityError, match="sha256"):
        load_model(copy, device="cpu")
    code, _, err = run_cli(["eval", "ppl", str(copy), "--text", str(bundles.calib), "--ctx", "16",
                            "--max-windows", "1"], capsys)
    assert code == 4 and "does not match engine.json" in err and "Traceback" not in err, err


def test_serve_refuses_a_block_size_the_bundle_was_not_compiled_for(bundles: Bundles) -> None:
    import subprocess
    import sys

    engine = bundles.engine("w4a16")
    assert json.loads((engine / "engine.json").read_text())["kv_cache"]["block_size"] == 16
    proc = subprocess.run([sys.executable, "-m", "lmfoundry.cli", "serve", str(engine), "--block-size", "32",
                           "--port", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "compiled for --block-size 16" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_link_bundle_is_refused_with_the_fix(bundles: Bundles, tmp_path: Path) -> None:
    from lmfoundry.errors import UserError

    linked = build_engine(bundles.checkpoint("w4a16"), ["hopper"], tmp_path / "linked", weights="link",
                          progress=False).output
    with pytest.raises(UserError, match="--weights repack"):
        load_bundle(linked, "cpu")


def test_sliding_window_bundle_serves_up_to_its_window(bundles: Bundles) -> None:
    """The kernels attend causally over everything: exact for a windowed model (Mistral, window 16)
    while a sequence holds at most 16 tokens. The bundle's engine caps max_model_len there, refuses
    a longer one by name, and within it agrees with the reference executor (which honours the
    window at any length); eval's up-front check uses the same limit."""
    from lmfoundry.errors import UserError
    from lmfoundry.evals.checked_model import check_model

    model = tiny_model_folder(bundles.root / "mistral-sw", "mistral", torch_dtype="bfloat16", head_dim=64,
                               sliding_window=16)
    ckpt, engine = bundles.root / "mistral-sw-w4a16", bundles.root / "mistral-sw-w4a16-engine"
    main(["quantize", str(model), "-o", str(ckpt), "--quiet", "--num-samples", "2", "--seq-len", "32",
          "--calib", str(bundles.calib), *SCHEMES["w4a16"]])
    notes: list[str] = []
    build_engine(ckpt, ["hopper"], engine, progress=False, log=notes.append)
    assert any("sliding window of 16 tokens" in n for n in notes)
    assert json.loads((engine / "engine.json").read_text())["model"]["context_limit"] == 16
    ref_model, tok = load_model(ckpt, dtype=torch.bfloat16)
    kmodel, _ = load_bundle(engine, "cpu", interpret=False)
    reference, kernels = _engine(ref_model, tok), _engine(kmodel, tok)
    assert kernels.max_model_len == 16 and reference.max_model_len == 512
    with pytest.raises(UserError, match="sliding window of 16"):
        LLMEngine(kmodel, tok, EngineConfig(num_kv_blocks=64, max_model_len=64))
    with pytest.raises(ValueError, match="exceed the context of 16 tokens"):
        kernels.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0))
    assert check_model(str(engine), allow_bundle=True).context_limit == 16
    assert check_model(str(ckpt), allow_bundle=True).context_limit == 512
    prompt = PROMPTS[0]
    ids = prompt + reference.generate([prompt], SamplingParams(max_tokens=16 - len(prompt) - 1,
                                                               temperature=0))[0].outputs[0].token_ids
    bound = logit_bound(ref_model, ids)
    for pos, (r, k) in enumerate(zip(teacher_forced(reference, ids), teacher_forced(kernels, ids), strict=True)):
        assert abs(r.logprob - k.logprob) <= float(bound[pos]), (pos, r.logprob, k.logprob)


def test_perplexity_through_the_kernels(bundles: Bundles) -> None:
    from lmfoundry.evals.perplexity import perplexity

    ref_model, _ = load_model(bundles.checkpoint("w8a8"), dtype=torch.bfloat16)
    kmodel, _ = load_bundle(bundles.engine("w8a8"), "cpu", interpret=False)
    stream = torch.randint(3, 256, (4 * 32,), generator=torch.Generator().manual_seed(0))
    ref = perplexity(ref_model, stream, ctx=32, batch_size=2, progress=False)
    ker = perplexity(kmodel, stream, ctx=32, batch_size=2, progress=False)
    assert ker.tokens == ref.tokens and abs(ker.nll - ref.nll) < 0.01, (ker.nll, ref.nll)


def test_manifest_records_repacked_weights(bundles: Bundles) -> None:
    manifest = json.loads((bundles.engine("w4a16") / "engine.json").read_text())
    assert manifest["weights"]["mode"] == "repack"
    assert all("sha256" in f for f in manifest["weights"]["files"].values())


def _serve(args: list[str]):
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TRITON_INTERPRET="0")  # kernel references
    return subprocess.Popen([sys.executable, "-m", "lmfoundry.cli", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def test_serve_engine_dir_answers_the_openai_client(bundles: Bundles, tmp_path: Path) -> None:
    import shutil

    import openai

    engine = bundles.engine("w8a8")
    proc = _serve([str(engine), "--port", "0", "--device", "cpu", "--kv-cache-gb", "0.01"])
    try:
        url = wait_for_url(proc, timeout=180)
        client = openai.OpenAI(base_url=url, api_key="unused")
        name = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Hi"}]
        stream = client.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0,
                                                stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        whole = client.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0)
        assert whole.usage.completion_tokens >= 1 and text == whole.choices[0].message.content
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    # a tampered bundle is refused at start-up with one line and no traceback
    copy = tmp_path / "engine"
    shutil.copytree(engine, copy)
    (copy / "weights" / "config.json").write_text((copy / "weights" / "config.json").read_text() + " ")
    proc = _serve([str(copy), "--port", "0"])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "config.json: sha256" in out and "Traceback" not in out, out


def test_eval_gate_runs_the_bundle_and_records_the_verdict(bundles: Bundles, tmp_path: Path) -> None:
    import shutil

    import yaml

    from lmfoundry.evals.gate import run_gate

    engine = tmp_path / "engine"
    shutil.copytree(bundles.engine("w8a8"), engine)
    text = write_text(tmp_path / "ppl.txt", n_words=600, seed=3)
    gate = {"name": "bundle", "seed": 0, "confidence": 0.95, "resamples": 200,
            "prompt": {"add_bos": "tokenizer", "chat_template": False, "num_fewshot": 0},
            "defaults": {"min_recovery": 0.5, "max_ppl_ratio": 1.05},
            "tiers": {"quick": {"tasks": {"lmf_arc_easy": {"limit": 4, "gate": ["acc"]}},
                                "perplexity": {"text": str(text), "ctx": 32, "windows": 4}}}}
    (tmp_path / "gate.yaml").write_text(yaml.safe_dump(gate))
    res = run_gate(str(engine), str(bundles.checkpoint("w8a8")), str(tmp_path / "gate.yaml"), "quick",
                   tmp_path / "out", use_cache=False, device="cpu")
    ppl = [m for m in res.report["metrics"] if m["name"].startswith("perplexity/")][0]
    assert abs(ppl["point"] - 1.0) < 0.02  # same weights, kernels vs reference: ratio ~1
    manifest = json.loads((engine / "engine.json").read_text())
    assert manifest["promotion"]["verdict"] == res.verdict
    load_bundle(engine, "cpu", interpret=False)  # the verdict does not break the bundle's hashes


@pytest.mark.parametrize("scheme", ["w4a16-actorder", "w8a8", "w4a16-kv-int8"])
def test_gpu_bundle_on_cpu_serves_the_packed_reference_model(bundles: Bundles, scheme: str) -> None:
    """`serve ENGINE --device cpu` (load_model on CPU) un-tiles and un-fuses a repacked bundle back
    to the checkpoint's tensors (exact) and runs the packed reference model, not the kernels'
    per-op references: every weight buffer equals the checkpoint's own packed load."""
    from lmfoundry.model.reference import CausalLM
    from lmfoundry.runtime.cpu.weight_only_linears import Int4PackLinear

    model, _ = load_model(bundles.engine(scheme), dtype=torch.bfloat16)
    ref, _ = load_model(bundles.checkpoint(scheme), dtype=torch.bfloat16)
    assert isinstance(model, CausalLM)
    if scheme.startswith("w4a16"):
        assert isinstance(model.model.layers[0].mlp.down_proj, Int4PackLinear)
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert [type(m) for m in model.modules()] == [type(m) for m in ref.modules()]


def test_embeddings_through_the_kernels(bundles: Bundles) -> None:
    """/v1/embeddings on a bundle: the pooled final-norm hidden states of the bundle's ops agree
    with the reference executor's (bf16 rounding apart), chunked under a small step budget."""
    ref_model, tok = load_model(bundles.checkpoint("w4a16"), dtype=torch.bfloat16)
    kmodel, _ = load_bundle(bundles.engine("w4a16"), "cpu", interpret=False)
    prompts = [*PROMPTS, list(range(1, 150))]  # the last one in three chunks
    want = torch.tensor(_engine(ref_model, tok).embed(prompts))
    got = torch.tensor(_engine(kmodel, tok).embed(prompts))
    assert kmodel.kernels.stats["reference"] > 0  # the bundle's ops ran
    cosine = (want * got).sum(dim=-1)  # unit vectors
    assert cosine.min() > 0.9995, cosine  # the pre-norm residual would score about 0.995 here
