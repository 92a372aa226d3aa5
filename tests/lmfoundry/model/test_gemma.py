"""Gemma 2 and Gemma 3 (text): the Llama layer with (1 + w) norms, a scaled embedding, norms after
each branch, a tanh-GELU MLP, a custom attention scale, soft-capped scores (Gemma 2) and logits,
sliding-window layers, and (Gemma 3) q/k norms and a second rope base for the sliding layers.

Tiny random models are built offline with transformers' own classes and saved as HF folders; our
forward must equal transformers' in float32, every quantization method must produce a checkpoint
transformers loads with logits close to ours, and the engine must serve it token for token like
transformers' greedy generate. Sequences are longer than the sliding window (8) and the scores
large enough for the soft-cap (4.0) to bend them, so neither feature can be dropped unnoticed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import GEMMA_WINDOW as WINDOW
from helpers import hf_eager, reference_greedy, tiny_gemma_folder

from lmfoundry.calibration.job import QuantizeJob, run_job
from lmfoundry.errors import UserError
from lmfoundry.model.config import ModelConfig
from lmfoundry.recipe import Recipe
from lmfoundry.runtime.loader import load_model

IDS = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module", params=["gemma2", "gemma3_text"])
def gemma(request, tmp_path_factory) -> Path:
    return tiny_gemma_folder(tmp_path_factory.mktemp(request.param) / "src", request.param)


def test_config_reads_the_gemma_switches(gemma: Path) -> None:
    cfg = ModelConfig.from_file(gemma)
    assert cfg.norm_offset == 1.0 and cfg.sandwich_norms and cfg.embed_scale == pytest.approx(128**0.5)
    assert cfg.attention_scale == pytest.approx(24**-0.5) and cfg.final_logit_softcapping == 10.0
    assert [cfg.layer_window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    if cfg.model_type == "gemma2":
        assert cfg.attn_logit_softcapping == 4.0 and not cfg.qk_norm and cfg.rope_kinds == ("full_attention",)
    else:
        assert cfg.qk_norm and cfg.attn_logit_softcapping is None
        assert [cfg.layer_rope(i) for i in range(4)] == [1, 0, 1, 0]
        (full, s_full), (local, s_local) = cfg.rope_inv_freq("full_attention"), cfg.rope_inv_freq("sliding_attention")
        # linear scaling divides the global frequencies by the factor; the local base is 1e4
        assert s_full == s_local == 1.0
        assert torch.allclose(full, 1.0 / (1e6 ** (torch.arange(0, 32, 2) / 32)) / 4.0)
        assert torch.allclose(local, 1.0 / (1e4 ** (torch.arange(0, 32, 2) / 32)))


def test_reference_forward_equals_transformers(gemma: Path) -> None:
    """float32 on both sides, same op order up to matmul blocking: 1e-5 of the logits' range. The
    window, the soft-caps and the embedding scale each change the logits by far more (checked)."""
    ours, _ = load_model(str(gemma))
    hf = hf_eager(gemma)
    with torch.no_grad():
        a, b = ours(IDS).float(), hf(IDS).logits.float()
    assert IDS.shape[1] > 2 * WINDOW
    assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max()), float((a - b).abs().max())
    # each Gemma feature matters on this data: switching it off moves the logits by > 1 % of their range
    import dataclasses

    def no_window(m) -> None:  # type: ignore[no-untyped-def]
        for layer in m.model.layers:
            layer.self_attn.spec = dataclasses.replace(layer.self_attn.spec, window=None)

    def plain_scale(m) -> None:  # type: ignore[no-untyped-def]
        for layer in m.model.layers:
            layer.self_attn.spec = dataclasses.replace(layer.self_attn.spec, scale=32**-0.5)

    def no_attention_cap(m) -> None:  # type: ignore[no-untyped-def]
        for layer in m.model.layers:
            layer.self_attn.spec = dataclasses.replace(layer.self_attn.spec, softcap=None)

    def no_final_cap(m) -> None:  # type: ignore[no-untyped-def]
        m.lm_head._forward_hooks.clear()

    def no_embed_scale(m) -> None:  # type: ignore[no-untyped-def]
        m.config.embed_scale = None

    perturbations = [no_window, plain_scale, no_final_cap, no_embed_scale]
    if ours.config.model_type == "gemma2":
        perturbations.append(no_attention_cap)
    for perturb in perturbations:
        changed, _ = load_model(str(gemma))
        perturb(changed)
        with torch.no_grad():
            c = changed(IDS).float()
        assert float((c - b).abs().max()) > 1e-2 * float(b.abs().max()), perturb.__name__


# Bound on ||quantized logits - float logits|| / ||float logits|| per scheme. Symmetric 4-bit absmax
# rounding of a Gaussian group of 32 has a step of max|w| / 7 ~ 0.3 sigma, an RMS error of ~9 % per
# weight; 28 linears in series-with-residuals compound that to the ~0.3 measured here (RTN; GPTQ
# with 128 calibration tokens overfits to ~0.37, as on the Llama toy). 8-bit steps are 1/127
# (weights and per-token activations: ~3 % measured), FP8 e4m3 rounds to 2^-4 relative (~10 %).
# Logits unrelated to the float model's would be at ~1.4, a dropped norm or scale at >= 1.
LOGIT_ERROR = {"w4a16": 0.5, "w8a8": 0.1, "fp8-dynamic": 0.2}


@pytest.mark.parametrize("method,q", [("rtn", {"scheme": "w4a16", "group_size": 32}),
                                      ("gptq", {"scheme": "w4a16", "group_size": 32, "actorder": "static"}),
                                      ("awq", {"scheme": "w4a16", "group_size": 32, "symmetric": False}),
                                      ("smoothquant", {"scheme": "w8a8"}),
                                      ("fp8", {"scheme": "fp8-dynamic"})])
def test_every_method_quantizes_into_a_checkpoint_transformers_loads(gemma: Path, tmp_path: Path, method: str,
                                                                    q: dict) -> None:
    """The layer-wise pipeline (scaled embedding into layer 0, Gemma's norms around each branch,
    smoothing folded into (1 + w) gains) writes a checkpoint whose logits in transformers match
    ours. Bounds: the weight-only methods store what we run (float32 rounding apart: 1e-4 of the
    range); W8A8/FP8 differ by our per-token activation rounding (int8 1/127, fp8 2^-4 relative),
    which transformers does not apply. And the quantized model still computes the float one
    (`LOGIT_ERROR`)."""
    from transformers import AutoModelForCausalLM

    rec = Recipe().with_overrides(method=method, **q)
    rec = rec.with_overrides(source="tiny", num_samples=4, seq_len=32)
    out = tmp_path / "q"
    run_job(QuantizeJob(str(gemma), out, rec, progress=False))
    ours, _ = load_model(str(out))
    ref, _ = load_model(str(gemma))
    with torch.no_grad():
        a, f = ours(IDS).float(), ref(IDS).float()
    assert torch.isfinite(a).all()
    rel = float((a - f).norm() / f.norm())
    assert rel <= LOGIT_ERROR[q["scheme"]], rel
    if method != "awq":  # transformers 5 re-initializes asymmetric packed zero points (llm-compressor#1618)
        hf = AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
        with torch.no_grad():
            b = hf(IDS).logits.float()
        tol = {"smoothquant": 0.05, "fp8": 0.1}.get(method, 1e-4)
        assert float((a - b).abs().max()) <= tol * float(b.abs().max()), float((a - b).abs().max())


@pytest.mark.parametrize("method", ["awq", "smoothquant"])
def test_smoothing_leaves_the_float_gemma_unchanged(gemma: Path, method: str) -> None:
    """AWQ's and SmoothQuant's folds on every layer, no rounding: the logits equal the original
    within float32 rounding. Folding into the stored w instead of the applied (1 + w), or into
    post_attention_layernorm (which in Gemma normalizes attention's output, not the MLP's
    input), changes them by O(1)."""
    import copy

    from lmfoundry.model.reference import embed
    from lmfoundry.quantformat.scheme import make_scheme
    from lmfoundry.quantizers.awq import AWQQuantizer
    from lmfoundry.quantizers.base import LayerCalibration
    from lmfoundry.quantizers.smoothquant import SmoothQuantQuantizer

    model, _ = load_model(str(gemma))
    smoothed = copy.deepcopy(model)
    names = list(model.config.linear_shapes)
    with torch.no_grad():
        x = embed(model.config, smoothed.model.embed_tokens.weight, IDS)
        cos, sin = smoothed.model.rotary_emb(torch.arange(IDS.shape[1])[None], x.dtype)
        for i, layer in enumerate(smoothed.model.layers):
            calib = LayerCalibration([x], cos, sin)
            if method == "awq":
                quantizer = AWQQuantizer()
                schemes = dict.fromkeys(names, make_scheme("w4a16", group_size=32))
                calib.run(layer, quantizer.calibration_hooks(layer, schemes, i))
                assert len(quantizer.smooth_layer(layer, schemes)) == 4
            else:
                sq = SmoothQuantQuantizer({"alpha": 0.5})
                calib.run(layer, hooks=sq.calibration_hooks(layer, {}, i))
                sq.quantize_layer(layer, {}, calib, i)  # no linears to quantize: the folds only
            x = layer(x, cos, sin)
        before, after = model(IDS), smoothed(IDS)
    original = dict(model.named_parameters())
    changed = {n.split(".")[-2] for n, p in smoothed.named_parameters() if not torch.equal(p, original[n])}
    assert {"input_layernorm", "pre_feedforward_layernorm", "v_proj", "o_proj", "up_proj", "down_proj"} <= changed
    assert "post_attention_layernorm" not in changed and "post_feedforward_layernorm" not in changed
    assert float((after - before).abs().max()) <= 1e-4 * float(before.abs().max())


def test_pipeline_feeds_each_layer_what_the_model_computes(gemma: Path, tmp_path: Path, monkeypatch) -> None:
    """The calibration inputs of layer 0 are embedding rows times sqrt(hidden) (each one exactly a
    row of the scaled table), and with float propagation those of layer i are what our reference
    model's first i layers make of them. A missing embedding scale or a wrong layer function
    would still quantize, just worse, so it is checked here directly."""
    import lmfoundry.quantizers.methods as methods
    from lmfoundry.model.reference import embed
    from lmfoundry.quantizers.rtn import RTNQuantizer

    seen: dict[int, torch.Tensor] = {}

    class Recording(RTNQuantizer):
        needs_calibration = True

        def quantize_layer(self, layer, schemes, calib, layer_idx):  # type: ignore[no-untyped-def]
            seen[layer_idx] = torch.cat([x.clone() for x in calib.inputs])
            return super().quantize_layer(layer, schemes, calib, layer_idx)

    monkeypatch.setattr(methods, "get_quantizer", lambda method, options=None: Recording(options))
    rec = Recipe().with_overrides(method="rtn", scheme="w4a16", group_size=32)
    rec = rec.with_overrides(source="tiny", num_samples=4, seq_len=32)
    rec = rec.with_overrides(propagate="float")
    run_job(QuantizeJob(str(gemma), tmp_path / "q", rec, progress=False))

    model, _ = load_model(str(gemma))
    table = model.model.embed_tokens.weight * 128**0.5
    x0 = seen[0]
    dist = torch.cdist(x0.reshape(-1, x0.shape[-1]), table, compute_mode="donot_use_mm_for_euclid_dist")
    assert float(dist.min(-1).values.max()) <= 1e-5 * float(table.abs().max())  # scaled rows, exactly
    ids = dist.argmin(-1).reshape(x0.shape[:2])
    with torch.no_grad():
        h = embed(model.config, model.model.embed_tokens.weight, ids)
        cos, sin = model.model.rotary_emb(torch.arange(ids.shape[1])[None], h.dtype)
        for i, layer in enumerate(model.model.layers):
            assert torch.allclose(seen[i], h, rtol=1e-5, atol=1e-5 * float(h.abs().max())), i
            h = layer(h, cos, sin)


def test_layer_by_layer_pass_equals_the_layer(gemma: Path) -> None:
    """GPTQ's one-pass calibration (`run_sequential`, group by group) computes the layer itself,
    post-branch norms included: otherwise every later layer is calibrated on wrong inputs."""
    from lmfoundry.model.reference import embed
    from lmfoundry.quantizers.base import LayerCalibration

    model, _ = load_model(str(gemma))
    with torch.no_grad():
        x = embed(model.config, model.model.embed_tokens.weight, IDS)
        cos, sin = model.model.rotary_emb(torch.arange(IDS.shape[1])[None], x.dtype)
        for layer in model.model.layers:
            want = layer(x, cos, sin)
            got = LayerCalibration([x.clone()], cos, sin).run_sequential(layer, lambda g, h: None, lambda g: None)[0]
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
            x = want


def test_smoothing_folds_into_the_gemma_gain_exactly() -> None:
    """Dividing a Gemma norm's applied gain (1 + w) by s divides its output by s (not (w / s))."""
    from lmfoundry.model.reference import RMSNorm

    torch.manual_seed(1)
    norm = RMSNorm(16, 1e-6, offset=1.0)
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.3)
    x, s = torch.randn(5, 16), torch.rand(16) + 0.5
    before = norm(x)
    norm.divide_gain_(s)
    assert torch.allclose(norm(x), before / s, rtol=1e-5, atol=1e-6)


def test_gemma_gain_fold_stored_in_bfloat16_realizes_the_factor_it_returns() -> None:
    """Folding s = 1..100 into (1 + w) and storing bfloat16: the stored weight (1 + w) / s - 1
    sits near -1, where bfloat16's spacing is 2^-8, so a gain of 0.01 would be off by up to 20 %.
    `divide_gain_` rounds the weight itself and returns old gain / stored gain, the factor the
    smoothed linears must take for the checkpoint to hold exactly the float function."""
    from lmfoundry.model.reference import RMSNorm

    torch.manual_seed(2)
    norm = RMSNorm(64, 1e-6, offset=1.0)
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.3)
    x, s = torch.randn(7, 64), torch.logspace(0, 2, 64)
    before, gain = norm(x), 1.0 + norm.weight.detach().clone()
    naive = 1.0 + ((gain / s - 1.0).to(torch.bfloat16).float())  # what storing the plain fold keeps
    assert float((naive * s / gain - 1.0).abs().max()) > 0.05
    realized = norm.divide_gain_(s, torch.bfloat16)
    assert torch.equal(norm.weight, norm.weight.to(torch.bfloat16).float())  # what the checkpoint holds
    with torch.no_grad():
        assert torch.allclose(norm(x) * realized, before, rtol=1e-5, atol=1e-6)
    # within one bfloat16 step of the stored weight (2^-8 near -1) of the factor asked for
    assert float((gain / realized - gain / s).abs().max()) <= 2.0**-8


def test_engine_serves_gemma_like_transformers_generate(gemma: Path, tmp_path: Path) -> None:
    """The engine (paged KV cache, chunked prefill: 8 tokens per step, blocks of 4) generates past
    the sliding window what transformers' greedy `generate` does, for the float model and for a
    quantized checkpoint (against our full recompute of the same loaded model). Greedy tokens
    alone barely see the attention scale or soft-cap (argmax is robust), so the log-probability
    of every generated token must also equal transformers' full forward on the final sequence:
    float32 both sides, so within 1e-4 (the scale, the cap or the window off moves them by more)."""
    from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams

    hf = hf_eager(gemma)
    model, _ = load_model(str(gemma))
    prompts = [IDS[0, :7].tolist(), IDS[1, :13].tolist()]
    new = 14  # 13 + 14 tokens: several windows of 8
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, logprobs=0)
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=8))
    outs = engine.generate(prompts, params)
    for p, o in zip(prompts, outs, strict=True):
        got = o.outputs[0].token_ids
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, min_new_tokens=new,
                               pad_token_id=3)[0, len(p):].tolist()
            full = torch.log_softmax(hf(torch.tensor([p + want])).logits[0].float(), dim=-1)
        assert got == want
        hf_logprobs = [float(full[len(p) + j - 1, t]) for j, t in enumerate(want)]
        engine_logprobs = [lp.logprob for lp in o.outputs[0].logprobs]
        assert max(abs(a - b) for a, b in zip(engine_logprobs, hf_logprobs, strict=True)) <= 1e-4

    rec = Recipe().with_overrides(method="rtn", scheme="w4a16", group_size=32)
    run_job(QuantizeJob(str(gemma), tmp_path / "q", rec, progress=False))
    qmodel, _ = load_model(str(tmp_path / "q"))
    engine = LLMEngine(qmodel, None, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=8))
    outs = engine.generate(prompts, params)
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == reference_greedy(qmodel, p, new)


def test_unsupported_variants_are_refused_by_name(gemma: Path) -> None:
    cfg = json.loads((gemma / "config.json").read_text())
    with pytest.raises(UserError, match="use_bidirectional_attention"):
        ModelConfig.from_dict({**cfg, "use_bidirectional_attention": True})
    with pytest.raises(UserError, match="hidden_activation 'relu'"):
        ModelConfig.from_dict({**cfg, "hidden_activation": "relu"})
    with pytest.raises(UserError, match="layer_types"):
        ModelConfig.from_dict({**cfg, "layer_types": ["sliding_attention", "chunked_attention", "x", "y"]})
    with pytest.raises(UserError, match="gemma3.*vision"):
        ModelConfig.from_dict({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                               "text_config": cfg})
    with pytest.raises(UserError, match="gemma3n"):
        ModelConfig.from_dict({**cfg, "model_type": "gemma3n"})
    with pytest.raises(UserError, match="compiled-kernel"):  # engine bundles: the kernels are Llama's
        from lmfoundry.runtime.kernel_model import load_kernel_model

        bundle = gemma.parent / "bundle"
        (bundle / "weights").mkdir(parents=True, exist_ok=True)
        (bundle / "weights" / "config.json").write_text(json.dumps(cfg))
        load_kernel_model(bundle, type("K", (), {"manifest": {}})(), torch.device("cpu"))


def test_legacy_gemma3_config_keys() -> None:
    """Hub Gemma 3 configs written before transformers 5: `rope_theta` + `rope_scaling` for the
    full layers, `rope_local_base_freq` for the sliding ones, `sliding_window_pattern` instead of
    `layer_types` (one full layer every 6), and defaults for omitted fields (head_dim 256)."""
    cfg = ModelConfig.from_dict({
        "model_type": "gemma3_text", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 7, "num_attention_heads": 2, "num_key_value_heads": 1, "rope_theta": 1e6,
        "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": 512, "sliding_window_pattern": 6})
    assert cfg.head_dim == 256 and cfg.tie_word_embeddings and cfg.attention_scale == 256**-0.5
    assert [cfg.layer_window(i) for i in range(7)] == [512] * 5 + [None, 512]
    exponent = torch.arange(0, 256, 2) / 256
    full, _ = cfg.rope_inv_freq("full_attention")
    local, _ = cfg.rope_inv_freq("sliding_attention")
    assert torch.allclose(full, 1.0 / 1e6**exponent / 8.0) and torch.allclose(local, 1.0 / 1e4**exponent)
    llama = ModelConfig.from_dict({**cfg.raw, "model_type": "llama", "head_dim": 32})
    assert not llama.needs_attention_spec and llama.embed_scale is None and llama.norm_offset == 0.0


def test_attention_context_without_gemma_support_is_refused(gemma: Path) -> None:
    """A KV-cache context that only runs plain causal attention (the `attend(layer, q, k, v)`
    protocol) must not serve Gemma: the model refuses it by name instead of attending wrong."""
    from lmfoundry.model.attention_math import causal_attention

    class PlainContext:
        def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return causal_attention(q[None], k[None], v[None])[0]

    model, _ = load_model(str(gemma))
    with pytest.raises(UserError, match=f"PlainContext.*{model.config.model_type}"):
        with torch.no_grad():
            model.hidden_states(IDS[0], torch.arange(IDS.shape[1]), PlainContext())


def test_eval_scoring_with_the_prefix_cache_equals_a_direct_forward(gemma: Path) -> None:
    """eval-gate's scorer (shared-prefix KV cache, extensions at absolute positions) applies
    Gemma's scale, soft-cap and sliding window like one plain forward of context+continuation:
    contexts longer than the window, several continuations per context; float32 over <= 40
    positions rounds ~1e-6 relative per log-prob."""
    import math

    import torch.nn.functional as F

    from lmfoundry.evals.lm_adapter import RuntimeLM, ScoreRequest

    model, tok = load_model(str(gemma))
    g = torch.Generator().manual_seed(1)
    jobs = []
    for n_ctx in (3, WINDOW + 5, 3 * WINDOW):
        ctx = torch.randint(3, 256, (n_ctx,), generator=g).tolist()
        for n in (1, 3):
            jobs.append(ScoreRequest(ctx, torch.randint(3, 256, (n,), generator=g).tolist()))
    got = RuntimeLM(model, tok, batch_tokens=64).score(jobs)
    for job, (ll, _) in zip(jobs, got, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([job.context + job.continuation]))[0, len(job.context) - 1:-1].double()
        ref = float(F.log_softmax(logits, -1).gather(1, torch.tensor(job.continuation)[:, None]).sum())
        assert math.isfinite(ll) and abs(ll - ref) <= 1e-5 * max(1.0, abs(ref)), (ll, ref)


@pytest.mark.parametrize("tied", [True, False])
def test_tensor_parallel_gemma_decodes_like_one_process(gemma: Path, tied: bool, tmp_path: Path) -> None:
    """`--tp 2` keeps Gemma's scaled embedding, soft-caps (once: the final one is elementwise on
    each rank's logit columns, whether the LM head is the embedding's or its own), sandwich norms
    and sliding windows: the same greedy tokens and logits."""
    from lmfoundry.model.config import ModelConfig
    from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams

    if not tied:
        gemma = tiny_gemma_folder(tmp_path / "untied", ModelConfig.from_file(gemma).model_type, tie_word_embeddings=False)

    prompts = [[5, 9, 33, 70, 12, 90, 17], [7, 8, 100, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]

    def run(tp: int) -> list[list[int]]:
        engine = LLMEngine.from_pretrained(str(gemma), dtype=torch.float32, config=EngineConfig(
            num_kv_blocks=64, block_size=4, tensor_parallel_size=tp))
        try:
            return [o.outputs[0].token_ids for o in engine.generate(
                prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))]
        finally:
            engine.close()

    assert run(2) == run(1)
    # greedy tokens cannot see a soft-cap applied twice (tanh is monotonic): the logits can
    from lmfoundry.runtime.engine.ranks import ShardSpec, load_sharded

    whole, _ = load_model(str(gemma), dtype=torch.float32)
    sharded, _ = load_sharded(ShardSpec(str(gemma), torch.float32, 2))
    try:
        with torch.inference_mode():
            torch.testing.assert_close(sharded(IDS), whole(IDS), rtol=1e-4, atol=1e-4)
    finally:
        sharded.close()
