"""From a checkpoint to the list of kernel specializations to build, and the fusions decided.

Decisions made here, and recorded in the bundle so the runtime does exactly what was compiled:
  - q/k/v become one GEMM (`self_attn.qkv_proj`) and gate/up one (`mlp.gate_up_proj`) when their
    schemes match in every layer and their tensors can be concatenated (packed zero points need
    whole int32 rows per member; act-order g_idx and static input scales must be identical);
  - RMSNorm is fused with the activation quantization of the GEMM it feeds (W8A8 / FP8), and with
    the residual add of the decoder's skip path;
  - W4A16/W8A16 GEMMs run `w4a16_tiled` on the tiled layout that compile/repack.py writes; an
    act-order (g_idx) down_proj has its K permutation folded into the rows of gate/up when those are
    W4A16 too (`mlp.down_proj.input_perm`: no activation gather at run time), other act-order GEMMs
    gather their input once per call;
  - every kernel is specialized on dtypes, the semantic constexprs, and a tile config per row
    bucket from the arch tables; one specialization covers every model shape that shares them;
  - with LoRA slots (`compile --max-loras N --max-lora-rank R`), the gathered LoRA shrink/expand
    pair (`kernels/lora.py`) for every product after fusion (q/k/v as one site of three parts where
    fused), at rank R; the bundle records the slots and rank the runtime may stack.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from lmfoundry.compile.source import Checkpoint, LinearScheme
from lmfoundry.engine_bundle.weight_layout import ACT_ORDER_FOLD
from lmfoundry.errors import UserError
from lmfoundry.kernels import registry, tiles
from lmfoundry.kernels.spec import TileConfig, Variant, triton_type
from lmfoundry.model.config import FUSED_LINEARS

KV_TYPE = {"int8": "i8", "fp8": "fp8e4nv"}
QUANT_OF_KIND = {"w8a8": 1, "fp8": 2}
QUANT_TYPE = {1: "i8", 2: "fp8e4nv"}


@dataclass
class Fusion:
    name: str
    kind: str  # concat_gemm | norm_quant
    members: list[str]
    applied: bool
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "members": self.members, "applied": self.applied,
                "reason": self.reason}


@dataclass
class Gemm:
    """One GEMM the runtime runs per layer (after fusion), or the LM head."""

    name: str
    n: int
    k: int
    scheme: LinearScheme
    bias: bool
    scale_dtype: str


@dataclass
class Spec:
    """One specialization to compile for one arch, and the shapes/rows it covers."""

    capability: int
    kernel: str
    types: dict[str, str]
    semantics: dict[str, Any]
    config: TileConfig
    covers: list[dict[str, Any]] = field(default_factory=list)
    aligned: list[str] = field(default_factory=list)

    @property
    def variant(self) -> Variant:
        return Variant(self.kernel, tuple(sorted(self.types.items())), tuple(sorted(self.semantics.items())))

    @property
    def sm(self) -> str:
        return tiles.SM_NAME[self.capability]

    def key(self) -> str:
        blob = json.dumps({"cap": self.capability, "v": self.variant.as_dict(), "c": self.config.as_dict(),
                           "a": sorted(self.aligned)}, sort_keys=True)
        return f"{self.kernel}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"

    def expected_sass(self) -> tuple[str, ...]:
        kd = registry.kernel(self.kernel)
        return kd.expect_sass(self.capability, self.config, self.types, self.semantics)

    def job(self, index: int, out_dir: str) -> dict[str, Any]:
        """The compile worker's job for this specialization (`compile.worker`), files into out_dir."""
        return {"id": index, "key": self.key(), "capability": self.capability, "sm": self.sm, "kernel": self.kernel,
                "types": self.types, "semantics": self.semantics, "config": self.config.as_dict(),
                "aligned": self.aligned, "out_dir": out_dir}


def aligned_params(kernel: str, shapes: list[dict[str, int]]) -> list[str]:
    """The integer params an AOT build of `kernel` may assume to be multiples of 16: those every
    covered shape gives such a value (`KernelDef.shape_ints`)."""
    kd = registry.kernel(kernel)
    ints = [kd.shape_ints(s) for s in shapes]
    return [p.name for p in kd.params if p.aligned and not p.is_pointer
            and all(isinstance(i.get(p.name), int) and i[p.name] % 16 == 0 for i in ints)]


@dataclass
class KernelBuild:
    capabilities: list[int]
    dtype: str
    kv_dtype: str
    block_size: int
    fusions: list[Fusion]
    gemms: list[Gemm]
    specs: list[Spec]
    lora: dict[str, int] | None = None  # {"max_loras", "max_rank"} the LoRA kernels were built for


def _lora_requests(gemms: list[Gemm], act: str, max_rank: int
                   ) -> list[tuple[str, dict[str, str], dict[str, Any], dict[str, int], str]]:
    """The shrink and expand of every adapted product (a layer's GEMMs after fusion, not the LM head)."""
    out: list[tuple[str, dict[str, str], dict[str, Any], dict[str, int], str]] = []
    for g in gemms:
        if g.name == "lm_head":
            continue
        parts = len(FUSED_LINEARS.get(g.name, (g.name,)))
        out.append(("lora_shrink", {"act": act}, {}, {"K": g.k, "S": parts * max_rank}, f"{g.name}.lora"))
        out.append(("lora_expand", {"act": act}, {"PARTS": parts}, {"N": g.n, "R": max_rank}, f"{g.name}.lora"))
    return out


def _layer_scheme(ck: Checkpoint, local: str) -> LinearScheme:
    schemes = {ck.schemes[f"model.layers.{i}.{local}"] for i in range(ck.config.num_layers)}
    if len(schemes) != 1:
        raise UserError(f"{local}: layers use different schemes ({', '.join(s.describe() for s in schemes)}); "
                        "mixed per-layer schemes are not supported by compile yet")
    return schemes.pop()


def _same_tensors(ck: Checkpoint, members: tuple[str, ...], suffix: str) -> bool | None:
    """True/False when every layer's members hold identical `suffix` tensors; None if absent."""
    from safetensors import safe_open

    names = [f"model.layers.{i}.{m}.{suffix}" for i in range(ck.config.num_layers) for m in members]
    if not all(n in ck.tensors for n in names):
        return None
    for i in range(ck.config.num_layers):
        first = None
        for m in members:
            name = f"model.layers.{i}.{m}.{suffix}"
            with safe_open(ck.path / ck.tensor_files[name], framework="pt") as f:
                t = f.get_tensor(name)
            if first is None:
                first = t
            elif not (t.shape == first.shape and bool((t == first).all())):
                return False
    return True


def _concat_fusion(ck: Checkpoint, fused: str, members: tuple[str, ...]) -> Fusion:
    schemes = [_layer_scheme(ck, m) for m in members]
    short = [m.split(".")[-1] for m in members]
    if len(set(schemes)) != 1:
        return Fusion(fused, "concat_gemm", list(members), False,
                      f"schemes differ "
                      f"({', '.join(f'{n}: {s.describe()}' for n, s in zip(short, schemes, strict=True))})")
    s = schemes[0]
    if s.kind == "w4a16" and not s.symmetric:
        assert s.bits is not None  # every w4a16 scheme has its bit width
        per = 32 // s.bits
        for m in members:
            n = ck.config.linear_shapes[m][0]
            if n % per:
                return Fusion(fused, "concat_gemm", list(members), False,
                              f"{m} has {n} rows, not a multiple of {per}: packed zero points cannot be concatenated")
    if s.actorder:
        same = _same_tensors(ck, members, "weight_g_idx")
        if not same:
            why = "g_idx tensors not present to compare" if same is None else "act-order g_idx differ"
            return Fusion(fused, "concat_gemm", list(members), False, why)
    if s.kind in ("w8a8", "fp8") and not s.input_dynamic:
        same = _same_tensors(ck, members, "input_scale")
        if not same:
            why = "static input scales not present to compare" if same is None else "static input scales differ"
            return Fusion(fused, "concat_gemm", list(members), False, why)
    return Fusion(fused, "concat_gemm", list(members), True, f"all {s.describe()}")



def _act_order_fold(ck: Checkpoint, fusions: dict[str, Fusion]) -> Fusion | None:
    """Whether down_proj's act-order permutation goes into the rows of gate/up (None: down_proj is
    not act-order). Its input is SiLU(gate) * up, element-wise per intermediate feature, so
    permuting gate's and up's output rows identically permutes down_proj's input for free; the
    tiled layout stores rows in any order, so gate/up must be W4A16 (any act-order of their own is
    a permutation of their K, independent of their rows)."""
    down = _layer_scheme(ck, "mlp.down_proj")
    if down.kind != "w4a16" or not down.actorder:
        return None
    gate_up = FUSED_LINEARS["mlp.gate_up_proj"]
    producers = ["mlp.gate_up_proj"] if fusions["mlp.gate_up_proj"].applied else list(gate_up)
    members = [*producers, "mlp.down_proj"]
    kinds = {_layer_scheme(ck, m).kind for m in gate_up}
    if kinds != {"w4a16"}:
        return Fusion(ACT_ORDER_FOLD, "act_order_fold", members, False,
                      f"gate/up are {'/'.join(sorted(kinds))}, not W4A16: down_proj gathers its input at run time")
    return Fusion(ACT_ORDER_FOLD, "act_order_fold", members, True,
                  "gate/up rows stored in down_proj's act order: no activation gather")


def _gemms(ck: Checkpoint, fusions: dict[str, Fusion]) -> list[Gemm]:
    cfg = ck.config
    out: list[Gemm] = []
    layer0 = "model.layers.0."
    done: set[str] = set()
    for fused, members in FUSED_LINEARS.items():
        if fusions[fused].applied:
            s = _layer_scheme(ck, members[0])
            n = sum(cfg.linear_shapes[m][0] for m in members)
            k = cfg.linear_shapes[members[0]][1]
            bias = cfg.qkv_bias if fused.startswith("self_attn") else cfg.mlp_bias
            if s.kind in ("w8a8", "fp8") and s.weight_strategy == "tensor":
                # Per-tensor scales of the members become one per-channel vector when concatenated.
                s = LinearScheme(s.kind, s.bits, s.group_size, s.symmetric, s.actorder, "channel",
                                 s.input_strategy, s.input_dynamic)
            out.append(Gemm(fused, n, k, s, bias, ck.scale_dtype(layer0 + members[0])))
            done.update(members)
    for local, (n, k) in cfg.linear_shapes.items():
        if local in done:
            continue
        bias = {"self_attn.o_proj": cfg.o_bias}.get(local, cfg.qkv_bias if local.startswith("self_attn") else cfg.mlp_bias)
        out.append(Gemm(local, n, k, _layer_scheme(ck, local), bias, ck.scale_dtype(layer0 + local)))
    out.append(Gemm("lm_head", cfg.vocab_size, cfg.hidden_size, ck.schemes["lm_head"], False, ck.scale_dtype("lm_head")))
    return out


def _check_arch(ck: Checkpoint, gemms: list[Gemm], capabilities: list[int]) -> None:
    uses_fp8 = [g.name for g in gemms if g.scheme.kind == "fp8"] + (["KV cache"] if ck.kv.dtype == "fp8" else [])
    for cap in capabilities:
        if uses_fp8 and cap < 89:
            raise UserError(
                f"FP8 needs sm_89 or newer; {tiles.ARCH_OF_CAPABILITY.get(cap, cap)} (sm_{cap}) has no FP8 tensor cores "
                f"({', '.join(uses_fp8[:3])} use FP8): drop that --arch or use an INT8/W4A16 checkpoint"
            )


def select_kernels(ck: Checkpoint, capabilities: list[int], block_size: int = 16,
              lora: tuple[int, int] | None = None) -> KernelBuild:
    """Everything to compile for `capabilities` (e.g. [90, 80]) and the fusions decided; with
    `lora` (max adapters, max rank), the LoRA kernels too."""
    cfg = ck.config
    act = triton_type(ck.dtype)
    fusions = {name: _concat_fusion(ck, name, members) for name, members in FUSED_LINEARS.items()}
    gemms = _gemms(ck, fusions)
    _check_arch(ck, gemms, capabilities)
    by_name = {g.name: g for g in gemms}
    kv_type = KV_TYPE.get(ck.kv.dtype, act)
    kv_quant = {"auto": 0, "int8": 1, "fp8": 2}[ck.kv.dtype]
    if not registry.supports("paged_attention", head_dim=cfg.head_dim, block_size=block_size):
        raise UserError(f"paged attention supports head_dim {registry.family('paged_attention').support.values['head_dim']}"
                        f" and block sizes {registry.family('paged_attention').support.values['block_size']}; "
                        f"got head_dim {cfg.head_dim}, --block-size {block_size}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise UserError(f"{cfg.num_heads} query heads are not a multiple of {cfg.num_kv_heads} KV heads")

    # Norm feeding each input GEMM: fuse the activation quantization when the consumer needs one.
    norm_fusions: list[Fusion] = []
    requests: list[tuple[str, dict[str, str], dict[str, Any], dict[str, int], str]] = []

    def consumers_quant(names: list[str]) -> tuple[int, bool] | None:
        schemes = {by_name[n].scheme for n in names}
        quants = {(QUANT_OF_KIND.get(s.kind, 0), bool(s.kind in QUANT_OF_KIND and not s.input_dynamic)) for s in schemes}
        return quants.pop() if len(quants) == 1 else None

    qkv_names = ["self_attn.qkv_proj"] if "self_attn.qkv_proj" in by_name else list(FUSED_LINEARS["self_attn.qkv_proj"])
    up_names = ["mlp.gate_up_proj"] if "mlp.gate_up_proj" in by_name else list(FUSED_LINEARS["mlp.gate_up_proj"])
    for norm, names in (("input_layernorm", qkv_names), ("post_attention_layernorm", up_names)):
        q = consumers_quant(names)
        fused_q = q is not None and q[0] != 0
        quant, static = q if q is not None and fused_q else (0, False)
        target = names[0].split(".")[-1] if len(names) == 1 else "/".join(n.split(".")[-1] for n in names)
        reason = ("consumers take per-token dynamic activations" if fused_q and not static else
                  "consumers take a static activation scale" if fused_q else
                  "consumers are not activation-quantized" if q is not None else "consumers quantize differently")
        norm_fusions.append(Fusion(f"{norm}+{target}.input_quant", "norm_quant", [norm, *names], fused_q, reason))
        for residual in (False, True) if norm == "input_layernorm" else (True,):
            requests.append(("rmsnorm_quant", {"act": act, "out": QUANT_TYPE.get(quant, act)},
                             {"APPLY_NORM": True, "HAS_RESIDUAL": residual, "QUANT": quant, "STATIC_SCALE": static},
                             {"H": cfg.hidden_size}, norm))
        if not fused_q:
            for n in names:  # each quantized consumer quantizes its own input
                s = by_name[n].scheme
                if s.kind in QUANT_OF_KIND:
                    requests.append(_quant_request(act, s, cfg.hidden_size, n))
    requests.append(("rmsnorm_quant", {"act": act, "out": act},
                     {"APPLY_NORM": True, "HAS_RESIDUAL": True, "QUANT": 0, "STATIC_SCALE": False},
                     {"H": cfg.hidden_size}, "model.norm"))
    if cfg.qk_norm:  # Qwen3: RMSNorm of each q and k head before rotary, rows of head_dim
        requests.append(("rmsnorm_quant", {"act": act, "out": act},
                         {"APPLY_NORM": True, "HAS_RESIDUAL": False, "QUANT": 0, "STATIC_SCALE": False},
                         {"H": cfg.head_dim}, "self_attn.qk_norm"))
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        s = by_name[name].scheme
        if s.kind in QUANT_OF_KIND:
            requests.append(_quant_request(act, s, by_name[name].k, name))

    for g in gemms:
        requests.extend(_gemm_requests(g, act))
    if lora is not None:
        if min(lora) < 1:
            raise UserError(f"--max-loras and --max-lora-rank must be at least 1, got {lora[0]} and {lora[1]}")
        requests.extend(_lora_requests(gemms, act, lora[1]))

    d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    fused_qkv = fusions["self_attn.qkv_proj"].applied
    q_stride = (hq + 2 * hkv) * d if fused_qkv else hq * d
    k_stride = (hq + 2 * hkv) * d if fused_qkv else hkv * d
    attn_sem = {"NUM_Q_HEADS": hq, "NUM_KV_HEADS": hkv, "HEAD_DIM": d, "PAGE": block_size, "KV_QUANT": kv_quant}
    requests += [
        ("silu_mul", {"act": act}, {}, {"I": cfg.intermediate_size}, "mlp.act_fn"),
        ("rotary", {"act": act}, {"NUM_Q_HEADS": hq, "NUM_KV_HEADS": hkv, "HEAD_DIM": d},
         {"Hq": hq, "Hkv": hkv, "D": d, "q_stride": q_stride, "k_stride": k_stride}, "self_attn.rotary"),
        ("store_kv", {"act": act, "kv": kv_type},
         {"NUM_KV_HEADS": hkv, "HEAD_DIM": d, "PAGE": block_size, "KV_QUANT": kv_quant},
         {"Hkv": hkv, "D": d, "k_stride": k_stride}, "self_attn.kv_cache"),
        ("paged_prefill", {"act": act, "kv": kv_type}, attn_sem, {"Hq": hq, "D": d, "q_stride": q_stride}, "self_attn.attn"),
        # decode is FlashDecoding: the split kernel (GQA group per program), then the LSE merge
        ("paged_decode_split", {"act": act, "kv": kv_type}, attn_sem, {"Hq": hq, "Hkv": hkv, "D": d, "q_stride": q_stride},
         "self_attn.attn"),
        ("paged_decode_reduce", {"act": act}, {"NUM_Q_HEADS": hq, "HEAD_DIM": d}, {"Hq": hq, "D": d}, "self_attn.attn"),
    ]

    specs: dict[tuple, Spec] = {}
    for cap in capabilities:
        for kernel, types, semantics, shape, used_by in requests:
            kd = registry.kernel(kernel)
            static_shape = {k: shape[k] for k in kd.static_shape}
            for lo, hi, config in tiles.buckets(cap, kernel, shape):
                sig = (cap, kernel, tuple(sorted(types.items())), tuple(sorted(semantics.items())), config)
                spec = specs.setdefault(sig, Spec(cap, kernel, dict(types), dict(semantics), config))
                cover = next((c for c in spec.covers if c["shape"] == static_shape and c["rows"] == [lo, hi]), None)
                if cover is None:
                    cover = {"shape": static_shape, "rows": [lo, hi], "used_by": [], "_shape": shape}
                    spec.covers.append(cover)
                if used_by not in cover["used_by"]:
                    cover["used_by"].append(used_by)
    for spec in specs.values():
        spec.aligned = aligned_params(spec.kernel, [c.pop("_shape") for c in spec.covers])
    fold = _act_order_fold(ck, fusions)
    return KernelBuild(list(capabilities), ck.dtype, kv_type, block_size,
                list(fusions.values()) + norm_fusions + ([fold] if fold is not None else []), gemms,
                list(specs.values()), {"max_loras": lora[0], "max_rank": lora[1]} if lora is not None else None)


def _quant_request(act: str, s: LinearScheme, width: int, used_by: str):
    quant = QUANT_OF_KIND[s.kind]
    return ("rmsnorm_quant", {"act": act, "out": QUANT_TYPE[quant]},
            {"APPLY_NORM": False, "HAS_RESIDUAL": False, "QUANT": quant, "STATIC_SCALE": not s.input_dynamic},
            {"H": width}, f"{used_by}.input_quant")


def _gemm_requests(g: Gemm, act: str) -> list[tuple[str, dict[str, str], dict[str, Any], dict[str, int], str]]:
    s = g.scheme
    if s.kind == "dense":
        return []  # torch / cuBLAS
    if s.kind == "w4a16":  # the tiled layout: act-order is a K permutation there, not a kernel variant
        assert s.bits is not None  # every w4a16 scheme has its bit width
        types = {"act": act, "scale": triton_type(g.scale_dtype)}
        sem = {"BITS": s.bits, "GROUP_SIZE": s.group_size or 0, "HAS_ZP": not s.symmetric, "HAS_BIAS": g.bias}
        shape = {"N": g.n, "K": g.k, "bits": s.bits, "group": s.group_size or 0}
        return [("w4a16_tiled", types, sem, shape, g.name)]
    kernel = "w8a8_gemm" if s.kind == "w8a8" else "fp8_gemm"
    types = {"a": QUANT_TYPE[QUANT_OF_KIND[s.kind]], "bscale": triton_type(g.scale_dtype), "out": act,
             "acc": "i32" if s.kind == "w8a8" else "fp32"}  # split-K partials: exact int32 / fp32
    sem = {"A_PER_TOKEN": s.input_strategy == "token", "B_PER_CHANNEL": s.weight_strategy == "channel",
           "HAS_BIAS": g.bias, "ACC_INT": s.kind == "w8a8"}
    return [(kernel, types, sem, {"N": g.n, "K": g.k}, g.name)]
