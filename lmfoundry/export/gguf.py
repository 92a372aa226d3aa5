"""Export a quantized checkpoint to GGUF (llama.cpp, Ollama, LM Studio) without requantizing.

Our integer codes map onto ggml's block formats exactly, so a GPTQ/AWQ checkpoint keeps what its
calibration bought instead of being re-rounded by llama.cpp's own quantizer:

- symmetric int4, any group size that is a multiple of 32 (or per channel): **Q4_0**, a block of 32
  codes u = c + 8 in 0..15 with one fp16 scale d; value (u - 8)·d = c·s. A group of 64 or 128 is
  2 or 4 blocks carrying the same scale.
- asymmetric int4: **Q4_1**, value u·d + m with d = s and m = -(8 + z)·s (our value (c - z)·s);
  m is rounded to fp16 and ggml computes u·d + m in two roundings, so this one is exact to fp16
  (relative 2^-11 of the scale), not to the bit.
- symmetric int8: **Q8_0**, value c·d.
Scales become fp16: a checkpoint quantized with `--dtype float16` has fp16 scales already and
exports bit-exactly (Q4_0/Q8_0); other scale dtypes are rounded and the summary reports the largest
relative change. Act-order with `weight_g_idx` (columns of a block from different groups),
activation-quantized schemes (W8A8, FP8) and other bit widths have no exact GGUF form and are
refused with the reason.

The token embedding (and any other float tensor) keeps its stored dtype unless `embedding_type`
says otherwise: F16, BF16, F32, or Q8_0 (ggml's own quantizer, blocks of 32 values with one fp16
scale: a quarter of F32's bytes; llama.cpp's converter keeps it as F16/Q8_0 in its common types).
The tokenizer's own BOS/EOS behaviour is written as `tokenizer.ggml.add_bos_token` /
`add_eos_token` (what it does when it encodes plain text), so llama.cpp prepends a BOS exactly when
transformers would; without the key llama.cpp guesses from the vocabulary type.

Llama's q/k rows are reordered from the rotate-half layout to the interleaved pairs llama.cpp's
rope expects (per head, rows i and i + D/2 become neighbours); Qwen2/Qwen3 use the rotate-half
("NEOX") rope in llama.cpp and keep their order. Tensor names come from the `gguf` package's map,
the tokenizer from the checkpoint's tokenizer.json (`gguf.vocab.BpeVocab`, merges and special
tokens via `SpecialVocab`), with the pre-tokenizer name llama.cpp's converter would give it
(`gguf_pretokenizer`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmfoundry.errors import UserError, disk_full
from lmfoundry.export import gguf_pretokenizer

ARCHES = {"llama": "LLAMA", "mistral": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3"}
EMBEDDING_TYPES = ("auto", "f32", "f16", "bf16", "q8_0")  # auto: the checkpoint's stored dtype
EMBEDDING_KEY = "model.embed_tokens.weight"
BLOCK = 32  # every ggml type used here has blocks of 32 values


@dataclass
class ExportReport:
    path: Path
    tensors: int = 0
    types: dict[str, int] = field(default_factory=dict)
    max_scale_rounding: float = 0.0  # largest |fp16(s) - s| / s over every exported scale
    bytes: int = 0
    tokenizer_pre: str = ""  # llama.cpp's pre-tokenizer name written (`tokenizer.ggml.pre`)


def ggml_type_of(args: Any) -> str:
    """The ggml block type a weight scheme maps to exactly (UserError when none does)."""
    if args.type != "int":
        raise UserError(f"{args.describe()} weights have no exact GGUF form (export integer wNa16 / int8 schemes)")
    if args.actorder == "dynamic":
        raise UserError("act-order with weight_g_idx mixes groups inside a GGUF block; quantize with "
                        "--actorder static to export")
    if args.strategy == "group" and int(args.group_size) % BLOCK:
        raise UserError(f"group size {args.group_size} is not a multiple of GGUF's block of {BLOCK}")
    if args.strategy not in ("group", "channel"):
        raise UserError(f"{args.strategy} weight scales have no GGUF form (use group or channel)")
    if args.num_bits == 4:
        return "Q4_0" if args.symmetric else "Q4_1"
    if args.num_bits == 8 and args.symmetric:
        return "Q8_0"
    raise UserError(f"{args.num_bits}-bit {'symmetric' if args.symmetric else 'asymmetric'} weights have no exact "
                    "GGUF block type (supported: int4 sym -> Q4_0, int4 asym -> Q4_1, int8 sym -> Q8_0)")


def _per_block(t: torch.Tensor, in_features: int) -> torch.Tensor:
    """A per-group (or per-channel) tensor [rows, groups] repeated to one entry per block of 32."""
    per_row = t.reshape(t.shape[0], -1)
    return per_row.repeat_interleave(in_features // BLOCK // per_row.shape[1], dim=1)


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def encode_blocks(qw: Any, kind: str) -> tuple[np.ndarray, float]:
    """(uint8 [rows, bytes per row] in ggml's block layout, largest relative scale rounding)."""
    codes = qw.q.to(torch.int16)
    rows, cols = codes.shape
    if cols % BLOCK:
        raise UserError(f"input dimension {cols} is not a multiple of GGUF's block of {BLOCK}")
    scale = _per_block(qw.scale.float(), cols)  # [rows, blocks]
    d16 = scale.to(torch.float16).float()
    rounding = float(((d16 - scale).abs() / scale.abs().clamp_min(1e-30)).max()) if scale.numel() else 0.0
    c = codes.reshape(rows, -1, BLOCK)
    if kind == "Q8_0":
        body = c.to(torch.int8).view(torch.uint8)
        parts = [_fp16_bytes(scale), body]
    else:
        u = (c + 8).to(torch.uint8)  # 0..15
        qs = u[..., :16] | (u[..., 16:] << 4)  # first 16 values in the low nibbles
        if kind == "Q4_0":
            parts = [_fp16_bytes(scale), qs]
        else:  # Q4_1: d, m, qs
            zp = _per_block(qw.zero_point.float(), cols)
            parts = [_fp16_bytes(scale), _fp16_bytes(-(8.0 + zp) * scale), qs]
    blocks = torch.cat(parts, dim=-1)  # [rows, blocks, bytes per block]
    return blocks.reshape(rows, -1).numpy(), rounding


def rope_interleave_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q/k projection (or its per-row scales) from HF's rotate-half order to the
    interleaved pairs of llama.cpp's llama rope: within each head, row i and row i + D/2 become
    rows 2i and 2i + 1."""
    d = t.shape[0] // heads
    order = torch.arange(d).view(2, d // 2).t().reshape(-1)
    index = (torch.arange(heads).unsqueeze(1) * d + order).reshape(-1)
    return t.index_select(0, index)


def rope_freq_factors(config: Any) -> torch.Tensor | None:
    """Per-frequency divisors of the base rotary frequencies for a scaled rope (Llama 3.1's
    `llama3` type): llama.cpp reads them from the `rope_freqs` tensor. None for the default rope;
    rope types that also scale the attention (YaRN, LongRoPE) have no such form and are refused."""
    theta, rope_type = config.rope
    if rope_type == "default":
        return None
    scaled, attention_scale = config.rope_inv_freq()
    if attention_scale != 1.0:
        raise UserError(f"rope type {rope_type!r} scales attention by {attention_scale:g}; GGUF export does not carry it")
    exponent = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    return ((1.0 / theta**exponent) / scaled).float()


def float_tensor(tensor: torch.Tensor, kind: str = "auto") -> tuple[np.ndarray, Any, str]:
    """(array, gguf raw dtype or None, label) of a float tensor stored as `kind` (one of
    EMBEDDING_TYPES; 1-D tensors stay F32 whatever is asked, as llama.cpp keeps norms)."""
    import gguf

    if kind == "auto":
        kind = "f32" if tensor.ndim == 1 or tensor.dtype == torch.float32 else \
            "bf16" if tensor.dtype == torch.bfloat16 else "f16"
    if tensor.ndim == 1 or kind == "f32":
        return tensor.float().numpy(), None, "F32"
    if kind == "bf16":
        t = tensor.to(torch.bfloat16).contiguous()
        return t.view(torch.uint8).reshape(*t.shape[:-1], -1).numpy(), gguf.GGMLQuantizationType.BF16, "BF16"
    if kind == "q8_0":
        if tensor.shape[-1] % BLOCK:
            raise UserError(f"Q8_0 needs rows of a multiple of {BLOCK} values, not {tensor.shape[-1]}")
        q8 = gguf.GGMLQuantizationType.Q8_0
        from gguf.quants import quantize

        return quantize(tensor.float().numpy(), q8), q8, "Q8_0"
    return tensor.to(torch.float16).numpy(), None, "F16"


def export_gguf(checkpoint: str | Path, output: Path, tokenizer_pre: str | None = None,
                progress: bool = True, embedding_type: str = "auto") -> ExportReport:
    """Write `checkpoint` (ours, compressed-tensors) as one GGUF file at `output` (written to a
    hidden file beside it and renamed at the end), the token embedding as `embedding_type`.
    `tokenizer_pre` is llama.cpp's pre-tokenizer name; None detects it (`gguf_pretokenizer`)."""
    if embedding_type not in EMBEDDING_TYPES:
        raise UserError(f"embedding type {embedding_type!r}: expected one of {', '.join(EMBEDDING_TYPES)}")
    import gguf
    from tqdm.auto import tqdm

    from lmfoundry.checkpoint.folder import CheckpointReader, decode_linear
    from lmfoundry.model.config import LAYER_LINEARS, ModelConfig

    reader = CheckpointReader(checkpoint)
    plan = reader.plan
    if plan is None:
        raise UserError(f"{checkpoint}: not a quantized checkpoint (export takes the output of `lmfoundry quantize`)")
    if plan.kv_cache is not None:
        raise UserError("GGUF has no calibrated KV-cache scales; export a checkpoint without --kv-cache")
    config = ModelConfig.from_dict(reader.config)
    arch_name = ARCHES.get(config.model_type)
    if arch_name is None:
        raise UserError(f"GGUF export supports {', '.join(sorted(ARCHES))}; this checkpoint is {config.model_type}")
    if config.sliding_window is not None:  # llama.cpp's LLAMA/QWEN graphs attend causally over everything
        raise UserError(f"{config.model_type} with a sliding window of {config.sliding_window} tokens has no GGUF "
                        "form here: llama.cpp would attend past the window")
    kinds = {}
    for g in plan.groups:
        if g.scheme.input_activations is not None:
            raise UserError(f"{g.scheme.name} quantizes activations; GGUF stores weight-only formats")
        kinds[g.scheme.name] = ggml_type_of(g.scheme.weights)
    tokenizer_pre = gguf_pretokenizer.tokenizer_pre(Path(reader.folder), tokenizer_pre)
    arch = getattr(gguf.MODEL_ARCH, arch_name)
    names = gguf.get_tensor_name_map(arch, config.num_layers)
    permute_qk = arch_name == "LLAMA"
    output = Path(output).expanduser().resolve()
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{output.parent}: cannot create the output folder ({exc.strerror or exc})") from None
    if not os.access(output.parent, os.W_OK):
        raise UserError(f"{output.parent}: not a writable folder")
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    report = ExportReport(output, tokenizer_pre=tokenizer_pre)
    writer = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[arch])
    try:
        _write_metadata(writer, reader, config, plan, kinds, tokenizer_pre)
        factors = rope_freq_factors(config)
        if factors is not None:  # llama.cpp divides each base frequency by its factor
            writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors.numpy())
            report.tensors += 1
            report.types["F32"] = report.types.get("F32", 0) + 1
        linear_names = {f"model.layers.{i}.{local}" for i in range(config.num_layers) for local in LAYER_LINEARS}
        if not config.tie_word_embeddings and plan.scheme_for("lm_head") is not None:
            linear_names.add("lm_head")
        done: set[str] = set()
        keys = sorted(reader.index)
        for key in tqdm(keys, desc="gguf", unit="tensor", disable=not progress):
            module, leaf = key.rsplit(".", 1)
            scheme = plan.scheme_for(module) if module in linear_names else None
            if scheme is not None and leaf != "bias":  # weight_packed, weight_scale, ...: one encode per linear
                if module in done:
                    continue
                done.add(module)
                qw = decode_linear(reader.prefixed(module), scheme)
                if permute_qk and module.endswith(("q_proj", "k_proj")):
                    heads = config.num_heads if module.endswith("q_proj") else config.num_kv_heads
                    qw.q, qw.scale = rope_interleave_rows(qw.q, heads), rope_interleave_rows(qw.scale, heads)
                    if qw.zero_point is not None:
                        qw.zero_point = rope_interleave_rows(qw.zero_point, heads)
                kind = kinds[scheme.name]
                data, rounding = encode_blocks(qw, kind)
                report.max_scale_rounding = max(report.max_scale_rounding, rounding)
                _add(writer, names, f"{module}.weight", data, getattr(gguf.GGMLQuantizationType, kind), report, kind)
                continue
            tensor = reader.get([key])[key]
            if permute_qk and key.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
                heads = config.num_heads if ".q_proj." in key else config.num_kv_heads
                tensor = rope_interleave_rows(tensor, heads)
            arr, raw, label = float_tensor(tensor, embedding_type if key == EMBEDDING_KEY else "auto")
            _add(writer, names, key, arr, raw, report, label)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=False)
        writer.close()
        os.replace(tmp, output)
    except BaseException as exc:
        writer.close()
        tmp.unlink(missing_ok=True)
        if isinstance(exc, Exception) and disk_full(exc):
            raise UserError(f"{output}: no space left on the device for the GGUF file; nothing was kept - free "
                            "space there or write elsewhere") from None
        raise
    report.bytes = output.stat().st_size
    return report


def _add(writer: Any, names: Any, key: str, data: np.ndarray, raw: Any, report: ExportReport, label: str) -> None:
    name = names.get_name(key, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise UserError(f"no GGUF name for tensor {key}")
    writer.add_tensor(name, data, raw_dtype=raw)
    report.tensors += 1
    report.types[label] = report.types.get(label, 0) + 1


def _write_metadata(writer: Any, reader: Any, config: Any, plan: Any, kinds: dict[str, str], pre: str) -> None:
    import gguf

    cfg = reader.config
    writer.add_name(Path(reader.folder).name)
    writer.add_context_length(int(cfg.get("max_position_embeddings", 4096)))
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    theta, _ = config.rope  # transformers 5 configs keep it under rope_parameters
    writer.add_rope_freq_base(theta)
    writer.add_rope_dimension_count(config.head_dim)
    if config.head_dim * config.num_heads != config.hidden_size:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    main = {"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
            "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[next(iter(kinds.values()))]
    writer.add_file_type(main)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _write_tokenizer(writer, Path(reader.folder), config.vocab_size, pre)


def _added_token_types(tokenizer_json: Path) -> dict[int, int]:
    """Token id -> GGUF token type of the tokenizer's added tokens, as llama.cpp's converter types
    them: CONTROL for special ones (and ones that look special, `<|...|>`), USER_DEFINED for the
    rest. Typed NORMAL, llama.cpp splits `<|im_start|>` into text pieces and chat breaks."""
    import json

    import gguf

    types = {}
    for item in json.loads(tokenizer_json.read_text(encoding="utf-8")).get("added_tokens") or []:
        content = str(item.get("content", ""))
        special = bool(item.get("special")) or (content.startswith("<|") and content.endswith("|>"))
        types[int(item["id"])] = int(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
    return types


def _write_tokenizer(writer: Any, folder: Path, n_vocab: int, pre: str) -> None:
    """BPE vocabulary from tokenizer.json, padded to the embedding's rows (llama.cpp requires one
    token per row), plus merges, special token ids and the chat template."""
    import gguf
    from gguf.vocab import BpeVocab, SpecialVocab

    if not (folder / "tokenizer.json").is_file():
        raise UserError(f"{folder}: no tokenizer.json (GGUF export embeds a BPE tokenizer)")
    try:
        vocab = BpeVocab(folder)
    except Exception as exc:  # gguf raises plain errors for tokenizers it cannot read
        raise UserError(f"{folder}/tokenizer.json: not a BPE tokenizer gguf can embed ({exc})") from None
    tokens, toktypes = [], []
    added = _added_token_types(folder / "tokenizer.json")
    for i, (text, _score, toktype) in enumerate(vocab.all_tokens()):
        tokens.append(text.encode("utf-8") if isinstance(text, str) else text)
        toktypes.append(int(added.get(i, toktype)))
    if len(tokens) > n_vocab:
        raise UserError(f"tokenizer has {len(tokens)} tokens but the embedding only {n_vocab} rows")
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]".encode())
        toktypes.append(int(gguf.TokenType.UNUSED))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(toktypes)
    special = SpecialVocab(folder, load_merges=True, n_vocab=n_vocab)
    special.add_special_token.update(added_special_tokens(folder))  # over gguf's guess from the post-processor
    special.add_to_gguf(writer)


def added_special_tokens(folder: Path) -> dict[str, bool]:
    """Whether the tokenizer prepends BOS and appends EOS when it encodes plain text ("bos",
    "eos": llama.cpp's `tokenizer.ggml.add_bos_token` / `add_eos_token`), read off what the
    tokenizer itself does rather than its config files (SmolLM2's says nothing, and llama.cpp then
    prepends a BOS the model never saw)."""
    from lmfoundry.checkpoint.tokenizer import load_tokenizer

    tok = load_tokenizer(folder)
    plain = tok.encode("a", add_special_tokens=False)
    ids = tok.encode("a")
    bos, eos = tok.bos_token_id, tok.eos_token_id
    return {"bos": bos is not None and len(ids) > len(plain) and ids[0] == bos,
            "eos": eos is not None and len(ids) > len(plain) and ids[-1] == eos}
