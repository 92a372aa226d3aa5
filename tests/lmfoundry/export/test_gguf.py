"""`lmfoundry export --format gguf`: our codes land in ggml blocks unchanged (checked against the
`gguf` package's own dequantizer, which is ggml's reference), and transformers' GGUF loader, a
reader that is not ours, computes the same logits as our runtime on the checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_one_error, run_cli_on_a_small_disk, tiny_model_folder

from lmfoundry.calibration.job import QuantizeJob, run_job
from lmfoundry.errors import UserError
from lmfoundry.export.gguf import export_gguf, rope_interleave_rows
from lmfoundry.recipe import Recipe

VOCAB = 49152  # the shipped model's BPE tokenizer (a GGUF embeds a BPE vocabulary)


def _bpe_model(path: Path, arch: str) -> Path:
    from lmfoundry.checkpoint.sources import resolve_model

    # transformers' GGUF reader takes Qwen3's head_dim from its config default (128), not from
    # the file's key_length (llama.cpp reads that): give the tiny Qwen3 that head_dim
    extra: dict = {"head_dim": 128} if arch == "qwen3" else {}
    if arch == "llama":  # transformers 5's config style, base not the default (SmolLM2: 100000)
        extra["rope_parameters"] = {"rope_type": "default", "rope_theta": 100000.0}
    src = tiny_model_folder(path, arch, vocab_size=VOCAB, **extra)
    smol = resolve_model("smollm2-135m")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (smol / name).is_file():
            shutil.copy(smol / name, src / name)
    return src


def _quantize(src: Path, out: Path, **q) -> Path:
    rec = Recipe().with_overrides(method="rtn", **q)
    run_job(QuantizeJob(str(src), out, rec, progress=False))
    return out


def _exact_dequant(qw) -> torch.Tensor:
    """codes x scale (minus zero point) in float32 without any rounding in between."""
    rows, cols = qw.q.shape

    def per_column(t: torch.Tensor) -> torch.Tensor:
        t = t.float().reshape(rows, -1)
        return t.repeat_interleave(cols // t.shape[1], dim=1)

    q = qw.q.float()
    if qw.zero_point is not None:
        q = q - per_column(qw.zero_point)
    return q * per_column(qw.scale)


@pytest.fixture(scope="module")
def llama_src(tmp_path_factory) -> Path:
    return _bpe_model(tmp_path_factory.mktemp("gguf") / "src", "llama")


@pytest.mark.parametrize("q,kind", [({"scheme": "w4a16", "group_size": 32}, "Q4_0"),
                                    ({"scheme": "w4a16", "group_size": 64}, "Q4_0"),
                                    ({"scheme": "w8a16", "per_channel": True}, "Q8_0")])
def test_codes_land_in_ggml_blocks_exactly(llama_src: Path, tmp_path: Path, q: dict, kind: str) -> None:
    """With fp16 scales (`--dtype float16`) every dequantized GGUF weight equals our codes times
    our scales bit for bit (q/k rows in llama.cpp's interleaved rope order)."""
    import gguf

    from lmfoundry.checkpoint.folder import CheckpointReader, decode_linear
    from lmfoundry.model.config import LAYER_LINEARS

    ckpt = _quantize(llama_src, tmp_path / "q", dtype="float16", **q)
    report = export_gguf(ckpt, tmp_path / "m.gguf", progress=False)
    assert report.max_scale_rounding == 0.0 and report.types[kind] == 14
    reader = CheckpointReader(ckpt)
    tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    short = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i in range(2):
        for local in LAYER_LINEARS:
            name = f"model.layers.{i}.{local}"
            t = tensors[f"blk.{i}.{short[local]}.weight"]
            assert t.tensor_type.name == kind
            ours = _exact_dequant(decode_linear(reader.prefixed(name), reader.plan.scheme_for(name)))
            if local in ("self_attn.q_proj", "self_attn.k_proj"):
                ours = rope_interleave_rows(ours, 4 if local.endswith("q_proj") else 2)
            theirs = gguf.quants.dequantize(t.data, t.tensor_type)
            assert np.array_equal(theirs, ours.numpy()), name


@pytest.mark.parametrize("arch,head", [("llama", "float"), ("llama", "w8a16"),
                                       pytest.param("qwen2", "float", marks=pytest.mark.slow),
                                       pytest.param("qwen2", "w8a16", marks=pytest.mark.slow),
                                       pytest.param("qwen3", "float", marks=pytest.mark.slow)])
def test_transformers_reads_the_gguf_like_our_runtime(tmp_path: Path, arch: str, head: str) -> None:
    """transformers dequantizes the GGUF (undoing the q/k interleave) and its logits equal our
    runtime's on the checkpoint: float32 throughout, scales rounded to fp16 on export (relative
    2^-11), so logits agree to ~1e-3 of their range and the greedy token is the same wherever the
    top two logits are further apart than twice that. Qwen2 is
    exported asymmetric (Q4_1), whose offset m = -(8 + z)·s is rounded to fp16 too: up to
    16·s·2^-11 per weight, an eighth of the symmetric case's step precision, so 4x the bound.
    A quantized LM head (`lm_head`, tied in the Qwen2 source) is written as its own Q8_0 tensor."""
    from transformers import AutoModelForCausalLM

    from lmfoundry.runtime.loader import load_model

    src = _bpe_model(tmp_path / "src", arch)
    ckpt = _quantize(src, tmp_path / "q", scheme="w4a16", group_size=32, symmetric=(arch != "qwen2"), lm_head=head)
    # SmolLM2's tokenizer files under a qwen2 config.json: transformers loads them as a Qwen2
    # tokenizer, whose ids on llama.cpp's check text no known model gives, so the name is said
    report = export_gguf(ckpt, tmp_path / "g" / "m.gguf", tokenizer_pre="smollm", progress=False)
    assert report.types.get("Q8_0", 0) == (head == "w8a16")
    ours, _ = load_model(str(ckpt))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "g"), gguf_file="m.gguf", dtype=torch.float32).eval()
    ids = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(ids).float(), hf(ids).logits.float()
    bound = (2e-3 if arch != "qwen2" else 8e-3) * float(a.abs().max())
    assert float((a - b).abs().max()) <= bound, float((a - b).abs().max())
    top2 = a.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * bound  # where the bound cannot swap the top two
    assert clear.float().mean() > 0.5 and torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])


def test_rope_base_and_llama3_frequency_factors(tmp_path: Path) -> None:
    """The rope base comes from either config style, and a Llama-3.1 rope (`llama3` type) is
    written as llama.cpp's `rope_freqs` divisors: base frequency / scaled frequency, which our
    own rope (transformers' init function) defines; its long wavelengths are divided by
    `factor` and its short ones kept."""
    import gguf

    from lmfoundry.export.gguf import rope_freq_factors
    from lmfoundry.model.config import ModelConfig

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    src = tiny_model_folder(tmp_path / "src", "llama", vocab_size=VOCAB, rope_parameters=rope,
                            max_position_embeddings=512)
    smol_tokenizer = _bpe_model(tmp_path / "bpe", "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol_tokenizer / name, src / name)
    config = ModelConfig.from_dict(__import__("json").loads((src / "config.json").read_text()))
    factors = rope_freq_factors(config)
    assert factors is not None and factors.shape == (config.head_dim // 2,)
    assert float(factors[0]) == pytest.approx(1.0) and float(factors[-1]) == pytest.approx(8.0)
    ckpt = _quantize(src, tmp_path / "q", scheme="w4a16", group_size=32)
    export_gguf(ckpt, tmp_path / "m.gguf", progress=False)
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    field = reader.fields["llama.rope.freq_base"]
    assert float(field.parts[field.data[0]][0]) == 500000.0
    stored = {t.name: t for t in reader.tensors}["rope_freqs.weight"]
    np.testing.assert_array_equal(np.asarray(stored.data, dtype=np.float32), factors.numpy())


@pytest.mark.parametrize("size", ["64k", pytest.param("4m", marks=pytest.mark.slow)])
def test_export_onto_a_full_disk_is_one_line_and_leaves_nothing(size, llama_src: Path, tmp_path: Path) -> None:
    """Issue 46: numpy's "Not enough free space" OSError (no errno) ended in a traceback."""
    ckpt = _quantize(llama_src, tmp_path / "q", scheme="w4a16", group_size=32)
    small = tmp_path / "small"
    small.mkdir()
    code, err, left = run_cli_on_a_small_disk(["export", str(ckpt), "-o", str(small / "m.gguf"), "--quiet"], small,
                                              size)
    assert_one_error(code, err, "no space left on the device", "m.gguf")
    assert code == 2 and left == []


def test_refuses_what_has_no_exact_gguf_form(llama_src: Path, tmp_path: Path) -> None:
    cases = {
        "act-order": ({"scheme": "w4a16", "group_size": 32, "actorder": "dynamic"}, "act-order"),
        "w8a8": ({"scheme": "w8a8"}, "quantizes activations"),
        "3-bit": ({"scheme": "w3a16", "group_size": 32}, "no exact GGUF block type"),
        "int8 asym": ({"scheme": "w8a16", "per_channel": True, "symmetric": False}, "no exact GGUF block type"),
    }
    for label, (q, message) in cases.items():
        method = "gptq" if "actorder" in q else ("smoothquant" if q["scheme"] == "w8a8" else "rtn")
        rec = Recipe().with_overrides(method=method, **q)
        rec = rec.with_overrides(source="tiny", num_samples=2, seq_len=16)
        out = tmp_path / label.replace(" ", "-")
        run_job(QuantizeJob(str(llama_src), out, rec, progress=False))
        with pytest.raises(UserError, match=message):
            export_gguf(out, tmp_path / f"{label}.gguf", progress=False)
        assert not list(tmp_path.glob(f"*{label}.gguf*"))  # nothing half-written
    with pytest.raises(UserError, match="not a quantized checkpoint"):
        export_gguf(llama_src, tmp_path / "float.gguf", progress=False)


def test_special_tokens_are_control_tokens_and_the_chat_template_rides_along(llama_src: Path,
                                                                              tmp_path: Path) -> None:
    """llama.cpp (and Ollama) parse `<|im_start|>` as one token only when its GGUF type is
    CONTROL; typed NORMAL it is split into text and chat echoes the prompt. Read back with the
    `gguf` package: every added special token of the tokenizer is CONTROL, the rest NORMAL."""
    import json

    import gguf

    ckpt = _quantize(llama_src, tmp_path / "q", scheme="w4a16", group_size=32)
    export_gguf(ckpt, tmp_path / "m.gguf", progress=False)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    field = reader.fields["tokenizer.ggml.token_type"]
    types = [int(field.parts[i][0]) for i in field.data]
    tokens_field = reader.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(tokens_field.parts[i]).decode() for i in tokens_field.data]
    added = json.loads((llama_src / "tokenizer.json").read_text())["added_tokens"]
    special = {item["id"] for item in added if item["special"]}
    assert "<|im_start|>" in {tokens[i] for i in special}
    for i in special:
        assert types[i] == gguf.TokenType.CONTROL, (tokens[i], types[i])
    assert all(types[i] == gguf.TokenType.NORMAL for i in range(len(tokens)) if i not in special
               and not tokens[i].startswith("[PAD"))
    from transformers import AutoTokenizer

    template = reader.fields["tokenizer.chat_template"]
    assert bytes(template.parts[template.data[0]]).decode() == AutoTokenizer.from_pretrained(ckpt).chat_template


@pytest.mark.slow
@pytest.mark.heavy
def test_llama_cpp_chats_on_our_gguf_like_serve(tmp_path: Path) -> None:
    """The chat bug users met: llama.cpp (the xllamacpp wheel, from benchmarks/peers/venvs.py's
    side venv) parses <|im_start|> as one token and its greedy chat reply on our export equals
    `serve`'s on the checkpoint. Skipped where that venv is not installed."""
    import os
    import subprocess
    import sys

    import httpx

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from helpers import start_serve, stop_serve, wait_for_url

    from benchmarks._servers import LLAMA_CPP_SHIM, free_port, stop, wait_ready
    from benchmarks.peers.venvs import is_installed, python_of

    if not is_installed("xllamacpp"):
        pytest.skip("no xllamacpp venv (python benchmarks/peers/venvs.py xllamacpp)")
    from lmfoundry.checkpoint.sources import resolve_model

    ckpt = _quantize(resolve_model("smollm2-135m"), tmp_path / "q", scheme="w4a16", group_size=32, dtype="float16")
    export_gguf(ckpt, tmp_path / "q.gguf", tokenizer_pre="smollm", progress=False)  # fp16 scales: bit-exact
    body = {"model": "model", "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    port = free_port()
    llama = subprocess.Popen([str(python_of("xllamacpp")), "-c", LLAMA_CPP_SHIM, str(tmp_path / "q.gguf"), str(port),
                              "1", "1", "2048"], env=dict(os.environ, OMP_NUM_THREADS="1"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, llama, 120)
        assert httpx.post(f"{url}/tokenize", json={"content": "<|im_start|>user"}).json()["tokens"][0] == 1
        theirs = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    finally:
        stop(llama)
    proc = start_serve([str(ckpt), "--port", "0", "--dtype", "float32", "--served-model-name", "model"])
    try:
        ours = httpx.post(f"{wait_for_url(proc)}/chat/completions", json=body, timeout=120).json()
    finally:
        stop_serve(proc)
    # llama.cpp multiplies with 8-bit activations, so a near-tie can flip a few words in; the
    # replies must open alike and llama.cpp's must not echo the chat markup (the bug: the prompt
    # split into text made the model continue the transcript)
    mine, other = ours["choices"][0]["message"]["content"], theirs["choices"][0]["message"]["content"]
    assert len(mine.split()) >= 5 and other.split()[:5] == mine.split()[:5], (mine, other)
    assert "im_start" not in other and "user" not in other.lower(), other


def _field(reader, name: str):
    """A GGUF metadata value (scalar) as Python."""
    f = reader.fields[name]
    return f.parts[f.data[0]][0]


def test_add_bos_token_is_what_the_tokenizer_does(llama_src: Path, tmp_path: Path) -> None:
    """SmolLM2's tokenizer prepends nothing (llama.cpp must not either: without the key it adds a
    BOS to BPE vocabularies); one whose post-processor prepends <|endoftext|> gets True."""
    import json

    import gguf
    from transformers import AutoTokenizer

    ckpt = _quantize(llama_src, tmp_path / "q", scheme="w4a16", group_size=32)
    export_gguf(ckpt, tmp_path / "m.gguf", progress=False)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    assert AutoTokenizer.from_pretrained(ckpt)("a").input_ids == AutoTokenizer.from_pretrained(ckpt)(
        "a", add_special_tokens=False).input_ids
    assert bool(_field(reader, "tokenizer.ggml.add_bos_token")) is False
    assert bool(_field(reader, "tokenizer.ggml.add_eos_token")) is False

    spec = json.loads((ckpt / "tokenizer.json").read_text())  # now a tokenizer that prepends BOS
    bos = next(t for t in spec["added_tokens"] if t["content"] == "<|endoftext|>")
    spec["post_processor"] = {"type": "TemplateProcessing",
                              "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                         {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                       {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [bos["id"]],
                                                                   "tokens": ["<|endoftext|>"]}}}
    (ckpt / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<|endoftext|>"}))
    assert AutoTokenizer.from_pretrained(ckpt)("a").input_ids[0] == bos["id"]
    # the BOS enters llama.cpp's check-text ids, so this variant is named, not identified
    export_gguf(ckpt, tmp_path / "bos.gguf", tokenizer_pre="smollm", progress=False)
    assert bool(_field(gguf.GGUFReader(tmp_path / "bos.gguf"), "tokenizer.ggml.add_bos_token")) is True


@pytest.mark.parametrize("kind,ratio", [("f16", 0.5), ("q8_0", 34 / 128)])
def test_the_embedding_can_be_stored_as_f16_or_q8_0(llama_src: Path, tmp_path: Path, kind: str, ratio: float) -> None:
    """`--embedding-type`: the token embedding in F16 (to half an fp16 ulp, subnormals included) or
    ggml's Q8_0 (ggml's own quantizer: within half a step of amax / 127 plus the step's own fp16
    rounding, 127 * 2^-11 of it), the rest of the file unchanged."""
    import gguf
    from gguf.quants import dequantize

    from lmfoundry.checkpoint.folder import CheckpointReader

    ckpt = _quantize(llama_src, tmp_path / "q", scheme="w4a16", group_size=32)
    base = export_gguf(ckpt, tmp_path / "f32.gguf", progress=False)
    small = export_gguf(ckpt, tmp_path / f"{kind}.gguf", progress=False, embedding_type=kind)
    want = CheckpointReader(ckpt).get(["model.embed_tokens.weight"])["model.embed_tokens.weight"].float()
    assert small.types[kind.upper()] == 1 and base.types["F32"] == small.types.get("F32", 0) + 1
    tensor = next(t for t in gguf.GGUFReader(tmp_path / f"{kind}.gguf").tensors if t.name == "token_embd.weight")
    assert tensor.tensor_type == getattr(gguf.GGMLQuantizationType, kind.upper())
    got = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).reshape(want.shape)
    blocks = want.reshape(want.shape[0], -1, 32)
    if kind == "q8_0":
        bound = blocks.abs().amax(-1, keepdim=True) / 127 * (0.5 + 127 * 2.0**-11) * 1.001
    else:
        bound = blocks.abs() * 2.0**-11 + 2.0**-25  # half an ulp; 2^-25: half the smallest fp16 subnormal
    assert bool(((got.reshape(blocks.shape) - blocks).abs() <= bound).all())
    saved = base.bytes - small.bytes
    assert saved == pytest.approx(want.numel() * 4 * (1 - ratio), rel=0.01)


def test_export_cli_refuses_an_unknown_embedding_type(llama_src: Path, tmp_path: Path, capsys) -> None:
    from helpers import run_cli

    code, _, err = run_cli(["export", str(llama_src), "-o", str(tmp_path / "x.gguf"), "--embedding-type", "q4"],
                           capsys)
    assert code == 2 and "--embedding-type" in err and not (tmp_path / "x.gguf").exists()
