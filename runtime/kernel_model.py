"""The decoder as the engine bundle's kernels run it: weights in their stored (packed) form, one
kernel call per op, in the order `lmfoundry compile` planned and fused.

Per layer: [residual add +] RMSNorm [+ activation quantization] -> fused q/k/v GEMM -> rotary (in
place on the q/k views) -> store K/V into the paged cache (quantizing on write) -> paged attention
(decode rows, then prefill chunks) -> o_proj -> [residual add +] RMSNorm [+ quantization] -> fused
gate/up GEMM -> SiLU-mul -> down_proj. The final norm takes the last residual add; the LM head is
a dense GEMM (or the kernel of its scheme).

Every op is a `lmfoundry.kernels` op bound to the `KernelSet` of `load_engine`: shipped cubins on a
matching GPU, Triton JIT where they do not fit (or under TRITON_INTERPRET=1 on CPU), each kernel's
PyTorch reference otherwise. Nothing here dequantizes a weight: a W4A16 layer keeps int4 codes
and scales resident, in the tiled layout compile wrote (`kernels.tiled_layout.TiledLinear`; an act-order
down_proj reads gate/up outputs that compile stored in its K order). This module holds no scheduling state; `KernelModelExecutor` feeds it the
flat inputs of one step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from lmfoundry.errors import UserError
from lmfoundry.kernels.kv_layout import PagedKVCache
from lmfoundry.kernels.paged_attention import decode_splits, device_sm_count
from lmfoundry.kernels.rotary import rope_tables
from lmfoundry.kernels.scaled_mm import ScaledLinear
from lmfoundry.kernels.tiled_layout import TiledLinear
from lmfoundry.kernels.w4a16 import PackedLinear
from lmfoundry.model.config import FUSED_LINEARS, ModelConfig
from lmfoundry.model.tensor_parallel import embed_vocab_share, gather_vocab_share

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
QUANT_DTYPE = {"int-quantized": torch.int8, "float-quantized": torch.float8_e4m3fn}


@dataclass
class Gemm:
    """One GEMM in its stored form: `dense` [N, K] weight, `tiled` (W4A16/W8A16 in the layout
    compile writes), `packed` (W4A16/W8A16 as compressed-tensors stores it: what `lmfoundry compile`
    replaces by `tiled`; kept for callers that build a model by hand) or `scaled` (W8A8 / FP8, with
    the quantized dtype its input takes)."""

    name: str
    dense: torch.Tensor | None = None
    packed: PackedLinear | None = None
    tiled: TiledLinear | None = None
    scaled: ScaledLinear | None = None
    quant_dtype: torch.dtype | None = None
    bias: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        if self.dense is not None:
            return self.dense.shape[0]
        return (self.tiled or self.packed or self.scaled).out_features  # type: ignore[union-attr]

    def nbytes(self) -> int:
        parts = [self.dense, self.bias]
        if self.tiled is not None:
            return self.tiled.nbytes() + sum(t.numel() * t.element_size() for t in parts if t is not None)
        if self.packed is not None:
            p = self.packed
            parts += [p.weight_packed, p.weight_scale, p.weight_zero_point, p.weight_g_idx]
        if self.scaled is not None:
            parts += [self.scaled.weight, self.scaled.weight_scale, self.scaled.input_scale]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: list[Gemm]  # one fused GEMM, or q, k, v
    o_proj: Gemm
    gate_up: list[Gemm]  # one fused GEMM, or gate, up
    down: Gemm
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


@dataclass
class AttentionInputs:
    """Device tensors describing one step's attention, rows ordered decodes first.

    decode: the first `num_decode` rows, one query each, over `decode_lens[b]` cached tokens.
    prefill: the remaining rows as `len(prefill_lens)` chunks (`cu_seqlens` offsets relative to
    the first prefill row); chunk b's keys are the first `prefill_lens[b]` slots of its table.
    """

    slots: torch.Tensor  # [T] int32
    num_decode: int
    decode_tables: torch.Tensor | None  # [Bd, max_blocks] int32
    decode_lens: torch.Tensor | None  # [Bd] int32
    prefill_tables: torch.Tensor | None  # [Bp, max_blocks] int32
    cu_seqlens: torch.Tensor | None  # [Bp + 1] int32
    prefill_lens: torch.Tensor | None  # [Bp] int32
    max_q_len: int = 0


@dataclass
class KernelModel:
    """Weights of one bundle on one device, and the forward pass through its kernels."""

    config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    kernels: Any  # lmfoundry.runtime.kernel_set.KernelSet
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: Gemm
    layers: list[LayerWeights]
    norm_quant: dict[str, bool]  # input_layernorm / post_attention_layernorm -> fused quantization
    kv_dtype: str  # auto | int8 | fp8
    kv_scales: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer [Hkv] fp32
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    # A tensor-parallel rank (`join`): which share of the whole model it is, and its collectives.
    # The weights and `config` are then the share's (`compile --tp`), so every kernel runs on the
    # rank's own shapes; the ranks meet after o_proj and down_proj, in the embedding and the logits.
    share: Any = None  # lmfoundry.model.tensor_parallel.RankShard
    comm: Any = None  # its Collectives
    # LoRA adapters (`runtime.engine.lora_adapters.LoRAStack`, with a bundle compiled with --max-loras): each
    # GEMM's output gets the step's per-row deltas through the bundle's shrink/expand kernels
    lora: Any = None

    def join(self, share: Any, comm: Any) -> None:
        """Make this model (loaded from rank `share.rank`'s bundle) one rank of a tensor-parallel group."""
        self.share, self.comm = share, comm

    @property
    def block_size(self) -> int:
        """Tokens per KV block the bundle's attention kernels were compiled for."""
        return int(self.kernels.manifest["kv_cache"]["block_size"])

    # ---- memory ------------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        """Bytes of resident weights (what a W4A16 bundle saves is visible here)."""
        total = self.embed.numel() * self.embed.element_size() + self.final_norm.numel() * self.final_norm.element_size()
        if self.lm_head.dense is not self.embed:
            total += self.lm_head.nbytes()
        for layer in self.layers:
            total += sum(g.nbytes() for g in (*layer.qkv, layer.o_proj, *layer.gate_up, layer.down))
            total += sum(t.numel() * t.element_size() for t in (layer.input_norm, layer.post_norm))
        return total

    def cache_dtype(self) -> torch.dtype:
        return {"int8": torch.int8, "fp8": torch.float8_e4m3fn}.get(self.kv_dtype, self.dtype)

    def allocate_cache(self, num_blocks: int, block_size: int) -> list[PagedKVCache]:
        cfg = self.config
        out = []
        for i in range(cfg.num_layers):
            ks, vs = self.kv_scales[i] if self.kv_scales else (None, None)
            out.append(PagedKVCache.allocate(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                             self.cache_dtype(), self.device, ks, vs))
        return out

    # ---- forward -----------------------------------------------------------------------------
    def _gemm(self, g: Gemm, x: torch.Tensor | None, xq: tuple[torch.Tensor, torch.Tensor] | None = None
              ) -> torch.Tensor:
        """y = x W^T for one stored GEMM; `xq` is the input already quantized by a fused norm (then
        `x` is None: the consumers of a fused norm read only its quantized output)."""
        ks = self.kernels
        if g.tiled is not None:
            return ks.w4a16_tiled_linear(x, g.tiled)
        if g.packed is not None:
            return ks.w4a16_linear(x, g.packed)
        if g.scaled is not None:
            op = ks.w8a8_gemm if g.quant_dtype == torch.int8 else ks.fp8_gemm
            if xq is None:
                assert x is not None
                xq = ks.rmsnorm_quant(x, None, quant_dtype=g.quant_dtype, static_scale=g.scaled.input_scale)[:2]
            return op(xq[0], xq[1], g.scaled, self.dtype)
        assert x is not None and g.dense is not None  # a dense GEMM: its input is never pre-quantized
        y = x @ g.dense.t()
        return y + g.bias if g.bias is not None else y

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, consumers: list[Gemm],
              fuse_quant: bool) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor]:
        """(normed x in the model dtype, or None when the norm quantizes for its consumers; that
        quantization; the new residual)."""
        eps = self.config.rms_norm_eps
        if fuse_quant:
            g = consumers[0]
            assert g.scaled is not None  # a norm quantizes only for W8A8 / FP8 consumers
            q, scale, res = self.kernels.rmsnorm_quant(x, weight, eps, quant_dtype=g.quant_dtype, residual=residual,
                                                       static_scale=g.scaled.input_scale)
            return None, (q, scale), (res if residual is not None else x)
        out, _, res = self.kernels.rmsnorm_quant(x, weight, eps, residual=residual)
        return out, None, (res if residual is not None else x)

    def decode_sm_count(self) -> int:
        """SMs the FlashDecoding splits should fill: the GPU's own; under the CPU interpreter the
        nominal count of the bundle's newest arch (the interpreted run then takes the split path a
        GPU of that arch would); 1 for the CPU references, where splitting only adds work."""
        if self.device.type == "cuda":
            return device_sm_count(self.device)
        if getattr(self.kernels, "mode", "") == "interpret":
            from lmfoundry.kernels import tiles

            return tiles.nominal_sm_count(max(int(a["capability"]) for a in self.kernels.manifest["archs"].values()))
        return 1

    def decode_splits(self, num_decode: int, table_width: int) -> int:
        """Context splits of this step's decode attention, the same in every layer. The bound on the
        context is the block table's width (known on the host: no device sync), so a CUDA graph
        captured for a batch bucket keeps the split count it was captured with."""
        return decode_splits(num_decode, self.config.num_kv_heads, table_width * self.block_size,
                             self.decode_sm_count(), self.block_size)

    def hidden_states(self, ids: torch.Tensor, positions: torch.Tensor, attn: AttentionInputs,
                      caches: list[PagedKVCache]) -> torch.Tensor:
        """Final-norm hidden states [T, H] for the flat batch (rows ordered as `attn` says)."""
        cfg, ks = self.config, self.kernels
        splits = (self.decode_splits(attn.num_decode, attn.decode_tables.shape[1])
                  if attn.num_decode and attn.decode_tables is not None else 1)
        hq_heads, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = self._embed(ids)
        residual: torch.Tensor | None = None
        t = x.shape[0]
        lora = self.lora if self.lora is not None and self.lora.engaged else None
        for i, layer in enumerate(self.layers):
            h, hq, residual = self._norm(x, layer.input_norm, residual, layer.qkv, self.norm_quant["input_layernorm"])
            parts = [self._gemm(g, h, hq) for g in layer.qkv]
            if lora is not None:
                self._add_lora(lora, layer.qkv, parts, h, residual, layer.input_norm)
            if len(parts) == 1:
                qkv = parts[0]
                q = qkv[:, : hq_heads * d].view(t, hq_heads, d)
                k = qkv[:, hq_heads * d : (hq_heads + hkv) * d].view(t, hkv, d)
                v = qkv[:, (hq_heads + hkv) * d :].view(t, hkv, d)
            else:
                q, k, v = (p.view(t, -1, d) for p in parts)
            if layer.q_norm is not None:  # Qwen3: per-head RMSNorm of q and k before rotary
                q = ks.rmsnorm_quant(q.reshape(-1, d), layer.q_norm, cfg.rms_norm_eps)[0].view(t, hq_heads, d)
                k = ks.rmsnorm_quant(k.reshape(-1, d), layer.k_norm, cfg.rms_norm_eps)[0].view(t, hkv, d)
            ks.apply_rotary(q, k, positions, self.cos, self.sin, q_out=q, k_out=k)
            ks.store_kv(k, v, caches[i], attn.slots)
            out = torch.empty((t, hq_heads, d), dtype=self.dtype, device=self.device)
            nd = attn.num_decode
            if nd:
                ks.paged_decode(q[:nd], caches[i], attn.decode_tables, attn.decode_lens, out=out[:nd],
                                num_splits=splits)
            if nd < t:
                ks.paged_prefill(q[nd:], caches[i], attn.prefill_tables, attn.cu_seqlens, attn.prefill_lens,
                                 attn.max_q_len, out=out[nd:])
            attn_out = out.view(t, hq_heads * d)
            x = self._gemm(layer.o_proj, attn_out)
            if lora is not None:
                lora.add(layer.o_proj.name, attn_out, x)
            x = self._reduce(x)
            h, hq, residual = self._norm(x, layer.post_norm, residual, layer.gate_up,
                                         self.norm_quant["post_attention_layernorm"])
            parts = [self._gemm(g, h, hq) for g in layer.gate_up]
            if lora is not None:
                self._add_lora(lora, layer.gate_up, parts, h, residual, layer.post_norm)
            gate_up = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
            act = ks.silu_mul(gate_up)
            x = self._gemm(layer.down, act)
            if lora is not None:
                lora.add(layer.down.name, act, x)
            x = self._reduce(x)
        out, _, _ = ks.rmsnorm_quant(x, self.final_norm, cfg.rms_norm_eps, residual=residual)
        return out

    def _add_lora(self, lora: Any, gemms: list[Gemm], outs: list[torch.Tensor], h: torch.Tensor | None,
                  residual: torch.Tensor, norm: torch.Tensor) -> None:
        """The LoRA deltas of a norm's consumers. Where the norm quantized its output for them
        (W8A8 / FP8) the adapters read the unquantized normed input, as on the float model: the
        norm of `residual` (the stream the fused norm normalized) again, without quantization."""
        if h is None:
            h = self.kernels.rmsnorm_quant(residual, norm, self.config.rms_norm_eps)[0]
        for g, y in zip(gemms, outs, strict=True):
            lora.add(g.name, h, y)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm is None:
            return self.embed.index_select(0, ids)
        return embed_vocab_share(self.embed, self.share.vocab_range()[0], ids, self.comm)

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel GEMM's partial sums joined over the ranks (as they are on one device)."""
        return partial if self.comm is None else self.comm.all_reduce(partial.contiguous())

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        y = self._gemm(self.lm_head, hidden.to(self.device))
        if self.comm is not None:
            _, _, per = self.share.vocab_range()
            y = gather_vocab_share(y, self.share.config.vocab_size, per, self.comm)
        return y.float()

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """float32 logits [B, T, V] of whole causal sequences (what `CausalLM.forward` returns), for
        perplexity: each row is one prefill chunk over a scratch paged cache of its own."""
        b, t = input_ids.shape
        bs = self.block_size
        width = -(-t // bs)
        caches = self.allocate_cache(b * width, bs)
        dev = self.device
        tables = torch.arange(b * width, dtype=torch.int32, device=dev).view(b, width)
        slots = (tables[:, :, None] * bs + torch.arange(bs, dtype=torch.int32, device=dev)).view(b, -1)[:, :t]
        attn = AttentionInputs(
            slots=slots.reshape(-1).contiguous(), num_decode=0, decode_tables=None, decode_lens=None,
            prefill_tables=tables, cu_seqlens=torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=dev),
            prefill_lens=torch.full((b,), t, dtype=torch.int32, device=dev), max_q_len=t)
        positions = torch.arange(t, dtype=torch.int32, device=dev).repeat(b)
        hidden = self.hidden_states(input_ids.to(dev).reshape(-1), positions, attn, caches)
        return self.logits(hidden).view(b, t, -1)


# ---- loading ---------------------------------------------------------------------------------------


def _scheme_gemm(name: str, tensors: dict[str, torch.Tensor], scheme: Any, in_features: int,
                 dtype: torch.dtype, device: torch.device) -> Gemm:
    """The stored tensors of one (possibly fused) linear as a kernel-ready `Gemm`."""
    def dev(t: torch.Tensor, to: torch.dtype | None = None) -> torch.Tensor:
        return t.to(device=device, dtype=to or t.dtype).contiguous()

    def dev_opt(t: torch.Tensor | None, to: torch.dtype | None = None) -> torch.Tensor | None:
        return None if t is None else dev(t, to)

    bias = dev_opt(tensors.get("bias"), dtype)
    stored = tensors.get("weight")
    if scheme is None or (stored is not None and stored.is_floating_point() and stored.element_size() > 1):
        if stored is None:
            raise UserError(f"{name}: no weight in the bundle")
        return Gemm(name, dense=dev(stored, dtype), bias=bias)
    fmt = scheme.format
    w = scheme.weights
    if fmt == "pack-quantized" and "tiled_meta" in tensors:
        tiled = TiledLinear.from_tensors(tensors).to(device)
        if tiled.bias is not None:
            tiled.bias = tiled.bias.to(dtype)
        return Gemm(name, tiled=tiled)
    if fmt == "pack-quantized":
        group = w.group_size if w.strategy == "group" else 0
        packed = PackedLinear(dev(tensors["weight_packed"]), dev(tensors["weight_scale"]), w.num_bits, group,
                              in_features, dev_opt(tensors.get("weight_zero_point")),
                              dev_opt(tensors.get("weight_g_idx"), torch.int32), bias)
        return Gemm(name, packed=packed)
    if fmt in QUANT_DTYPE:
        a = scheme.input_activations
        if a is None:
            raise UserError(f"{name}: {fmt} without input activations has no kernel in the bundle")
        # the weight scale stays in its stored dtype: compile built the GEMM for that type (`bscale`),
        # and a float32 copy would be another variant, run by Triton JIT instead of the cubin
        scale = tensors["weight_scale"].reshape(-1)
        input_scale = None if a.dynamic else dev(tensors["input_scale"].float().reshape(1))
        scaled = ScaledLinear(dev(tensors["weight"]), dev(scale), input_scale, bias)
        return Gemm(name, scaled=scaled, quant_dtype=QUANT_DTYPE[fmt])
    raise UserError(f"{name}: stored format {fmt!r} has no kernel")


def load_kernel_model(engine_dir: str | Path, kernels: Any, device: torch.device,
                      progress: Callable[[int], None] | None = None) -> KernelModel:
    """Read the bundle's (verified) weights onto `device` in the layout its kernels were built for."""
    from lmfoundry.checkpoint.folder import CheckpointReader
    from lmfoundry.engine_bundle.engine_manifest import own_weights
    from lmfoundry.engine_bundle.weight_layout import ACT_ORDER_FOLD, fuse_members, tile_layer

    engine = Path(engine_dir)
    manifest = kernels.manifest
    reader = CheckpointReader(own_weights(engine))
    cfg = ModelConfig.from_dict(reader.config)
    refusal = cfg.kernel_path_refusal()  # e.g. Gemma: the fused kernels would compute another model
    if refusal is not None:
        raise UserError(f"{engine}: {refusal}")
    dtype = DTYPES[manifest["model"]["dtype"]]
    applied = {f["name"] for f in manifest["fusions"] if f["applied"]}
    fold_act_order = ACT_ORDER_FOLD in applied
    plan = reader.plan

    def scheme_of(name: str) -> Any:
        return plan.scheme_for(name) if plan is not None else None

    def stored(prefix: str, local: str) -> list[tuple[str, dict[str, torch.Tensor], Any, int]]:
        """(local name, stored tensors, scheme, in_features) of the GEMM(s) of `local`, fused where
        compile fused them (at compile time, or here for a bundle whose weights were copied)."""
        name = f"{prefix}.{local}"
        if local in FUSED_LINEARS and local in applied:
            members = [f"{prefix}.{m}" for m in FUSED_LINEARS[local]]
            if any(reader.has(f"{name}.{t}") for t in ("weight", "weight_packed", "tiled_weight")):  # compile-time
                tensors = reader.prefixed(name)
            else:
                rows = [cfg.linear_shapes[m][0] for m in FUSED_LINEARS[local]]
                got = reader.get([n for n in reader.index if any(n.startswith(m + ".") for m in members)])
                tensors, _ = fuse_members(members, rows, got.__getitem__, got.__contains__)
            return [(local, tensors, scheme_of(members[0]), cfg.linear_shapes[FUSED_LINEARS[local][0]][1])]
        return [(m, reader.prefixed(f"{prefix}.{m}"), scheme_of(f"{prefix}.{m}"), cfg.linear_shapes[m][1])
                for m in FUSED_LINEARS.get(local, (local,))]

    def layer_gemms(prefix: str) -> dict[str, list[Gemm]]:
        """The layer's GEMMs by group (qkv, o_proj, gate_up, down). W4A16 weights not tiled at compile
        time (a bundle with copied weights) are tiled here by the same code (`tile_layer`)."""
        groups = {g: stored(prefix, g) for g in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                                  "mlp.down_proj")}
        entries = [e for es in groups.values() for e in es]
        formats = {}
        for local, _tensors, scheme, k in entries:
            w = scheme.weights if scheme is not None and scheme.format == "pack-quantized" else None
            formats[local] = (w.num_bits, w.group_size if w.strategy == "group" else 0, k) if w is not None else None
        if any(f is not None and "weight_packed" in t
               for (_, t, _, _), f in zip(entries, formats.values(), strict=True)):
            tiled = tile_layer({local: t for local, t, _, _ in entries}, formats, fold_act_order)
        else:
            tiled = {local: t for local, t, _, _ in entries}
        return {g: [_scheme_gemm(f"{prefix}.{local}", tiled[local], scheme, k, dtype, device)
                    for local, _, scheme, k in es] for g, es in groups.items()}

    def vec(name: str) -> torch.Tensor:
        return reader.get([name])[name].to(device=device, dtype=dtype).contiguous()

    layers: list[LayerWeights] = []
    kv_scales: list[tuple[torch.Tensor, torch.Tensor]] = []
    kv_dtype = manifest["kv_cache"]["dtype"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        gemms = layer_gemms(p)
        layers.append(LayerWeights(
            input_norm=vec(f"{p}.input_layernorm.weight"), post_norm=vec(f"{p}.post_attention_layernorm.weight"),
            qkv=gemms["self_attn.qkv_proj"], o_proj=gemms["self_attn.o_proj"][0],
            gate_up=gemms["mlp.gate_up_proj"], down=gemms["mlp.down_proj"][0],
            q_norm=vec(f"{p}.self_attn.q_norm.weight") if cfg.qk_norm else None,
            k_norm=vec(f"{p}.self_attn.k_norm.weight") if cfg.qk_norm else None))
        if kv_dtype != "auto":
            names = [f"{p}.self_attn.k_scale", f"{p}.self_attn.v_scale"]
            if not all(reader.has(n) for n in names):
                raise UserError(f"{engine}: the bundle's KV cache is {kv_dtype} but {names[0]} is missing")
            got = reader.get(names)
            k_scale, v_scale = (got[n].float().reshape(-1).expand(cfg.num_kv_heads).contiguous().to(device)
                                for n in names)
            kv_scales.append((k_scale, v_scale))
        if progress is not None:
            progress(i)
    embed = vec("model.embed_tokens.weight")
    if any(reader.has(f"lm_head.{t}") for t in ("weight", "weight_packed", "tiled_weight")):
        head = reader.prefixed("lm_head")
        w = scheme_of("lm_head")
        if "weight_packed" in head and w is not None and w.format == "pack-quantized":
            wa = w.weights
            head = tile_layer({"lm_head": head}, {"lm_head": (wa.num_bits, wa.group_size if wa.strategy == "group"
                                                              else 0, cfg.hidden_size)}, False)["lm_head"]
        lm_head = _scheme_gemm("lm_head", head, w, cfg.hidden_size, dtype, device)
    else:
        lm_head = Gemm("lm_head", dense=embed)  # tied embeddings
    norm_quant = {norm: any(f["applied"] and f["kind"] == "norm_quant" and f["members"][0] == norm
                            for f in manifest["fusions"]) for norm in ("input_layernorm", "post_attention_layernorm")}
    inv_freq, scaling = cfg.rope_inv_freq()
    cos, sin = rope_tables(inv_freq.to(device), cfg.max_position_embeddings, scaling)
    return KernelModel(cfg, dtype, device, kernels, embed, vec("model.norm.weight"), lm_head, layers, norm_quant,
                       kv_dtype, kv_scales, cos, sin)
