"""Pre-flight checks for a quantization plan (or an existing checkpoint): fail in a second, not
after an hour of calibration or at vLLM load time.

Checks, each a row of the report (status ok / info / warn / FAIL; any FAIL blocks):
- method × scheme: the quantizer accepts the scheme (e.g. smoothquant needs w8a8);
- quantization_config: the plan serializes through compressed-tensors' own schema;
- group size: divides every targeted linear's input dimension;
- fused modules: q/k/v share one scheme and gate/up share one, in every layer — vLLM loads them
  as one fused linear (qkv_proj, gate_up_proj) and rejects a checkpoint where they differ;
- target arch: FP8 needs sm_89+ (Ada, Hopper, Blackwell); our INT8 W8A8 and weight-only kernels
  need sm_80+ (Ampere);
- KV cache: what is quantized, how scales are obtained, who can serve it; for a checkpoint, that
  every layer carries `k_scale` and `v_scale`;
- memory: estimated peak host memory of calibration, and GPU memory of serving (weights + KV per
  token × context), checked against --gpu-mem.

`preflight(config, plan, quantizer, recipe, source_dtype)` runs the same checks at the start of
`quantize` on the objects the quantize job built (nothing is resolved or built twice) and raises
`UserError` on a blocking one. `lmfoundry doctor` builds those objects the same way
(`lmfoundry.quantizers.from_recipe`), reporting a step that fails as a row.

The doctor judges a whole job (quantizer, calibration, compressed-tensors schema, GPU arch from
`lmfoundry.gpus`, memory from `lmfoundry.capacity.arithmetic`), so it sits above the stages: it imports
the quantizers and calibration, and nothing below it imports the doctor; `lmfoundry doctor`
(lmfoundry/commands/doctor.py) and the quantize job (lmfoundry/calibration/job.py) call it.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from lmfoundry.errors import UserError
from lmfoundry.gpus import FP8_MIN_CAPABILITY, parse_arch
from lmfoundry.model.config import FUSED_LINEARS, ModelConfig
from lmfoundry.quantformat.scheme import QuantArgs, QuantizationPlan, Scheme
from lmfoundry.recipe import Recipe

if TYPE_CHECKING:
    from lmfoundry.quantizers.base import Quantizer

FUSED_GROUPS = tuple((fused.split(".")[-1], members) for fused, members in FUSED_LINEARS.items())

INT_KERNEL_MIN_CC = 80  # our INT8 W8A8 and weight-only kernels (mma.sync on Ampere and later)

OK, INFO, WARN, FAIL = "ok", "info", "warn", "FAIL"


@dataclass
class Check:
    name: str
    status: str
    detail: str


@dataclass
class DoctorReport:
    subject: str
    checks: list[Check] = field(default_factory=list)
    estimates: dict[str, Any] = field(default_factory=dict)

    def add(self, name: str, status: str, detail: str) -> None:
        self.checks.append(Check(name, status, detail))

    @property
    def blocking(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.status == WARN]

    def verdict(self) -> str:
        if self.blocking:
            names = ", ".join(dict.fromkeys(c.name for c in self.blocking))
            return f"verdict: BLOCKED - {len(self.blocking)} blocking problem(s) ({names})"
        return f"verdict: READY - no blocking problem ({len(self.warnings)} warning(s))"

    def table(self) -> str:
        w = max(len(c.name) for c in self.checks) if self.checks else 5
        lines = [f"doctor: {self.subject}", f"{'check':<{w}}  status  detail", f"{'-' * w}  ------  {'-' * 40}"]
        for c in self.checks:
            lines.append(f"{c.name:<{w}}  {c.status:<6}  {c.detail}")
        lines.append(self.verdict())
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"subject": self.subject, "checks": [asdict(c) for c in self.checks],
                "estimates": self.estimates, "blocking": len(self.blocking), "verdict": self.verdict()}


# ------------------------------------------------------------------------------------- parsing


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """`80GiB`, `80GB`, `81920MiB`, `80` (GiB) -> bytes."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise UserError(f"cannot read memory size {text!r}; write e.g. 80GiB, 24GB or 81920MiB")
    value, unit = float(m.group(1)), m.group(2).lower()
    return int(value * (_UNITS[unit] if unit else 2**30))


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


# ------------------------------------------------------------------------------------- checks
def scheme_label(s: Scheme | None) -> str:
    if s is None:
        return "not quantized"
    act = f", act {s.input_activations.describe()}" if s.input_activations else ""
    return f"{s.weights.describe()}{act}"


def check_fused(report: DoctorReport, plan: QuantizationPlan, config: ModelConfig) -> None:
    problems = []
    for i in range(config.num_layers):
        for fused, members in FUSED_GROUPS:
            schemes = {m: plan.scheme_for(f"model.layers.{i}.{m}") for m in members}
            keys = {None if s is None else (s.weights, s.input_activations) for s in schemes.values()}
            if len(keys) > 1:
                parts = "; ".join(f"{m.split('.')[-1]}: {scheme_label(s)}" for m, s in schemes.items())
                problems.append(f"layer {i} {fused}: {parts}")
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        report.add("fused modules", FAIL, f"{problems[0]}{more}; vLLM fuses these linears into one and "
                   "rejects mixed schemes: quantize all of them alike (targets/ignore)")
    else:
        report.add("fused modules", OK, "q/k/v and gate/up share one scheme in every layer")


def arch_requirements(plan: QuantizationPlan) -> list[tuple[int, str]]:
    """(minimum compute capability, why) for everything the plan uses."""
    reqs = []
    for g in plan.groups:
        s = g.scheme
        if s.weights.type == "float" or (s.input_activations and s.input_activations.type == "float"):
            reqs.append((FP8_MIN_CAPABILITY, f"{s.name}: FP8 tensor cores (sm_89+: Ada, Hopper, Blackwell)"))
        elif s.input_activations is not None:
            reqs.append((INT_KERNEL_MIN_CC, f"{s.name}: INT8 tensor-core W8A8 kernels (sm_80+)"))
        else:
            reqs.append((INT_KERNEL_MIN_CC, f"{s.name}: weight-only int{s.weights.num_bits} kernels (sm_80+)"))
    if plan.kv_cache is not None and plan.kv_cache.type == "float":
        reqs.append((INT_KERNEL_MIN_CC, "fp8 KV cache (stored fp8; sm_80/86 convert on read, sm_89+ native)"))
    return reqs


def check_arch(report: DoctorReport, plan: QuantizationPlan, arch: str | None) -> None:
    reqs = arch_requirements(plan)
    need = max((cc for cc, _ in reqs), default=0)
    why = "; ".join(w for _, w in reqs)
    if arch is None:
        report.add("target arch", INFO, f"needs sm_{need}+ ({why}); pass --arch to check a GPU")
        return
    name, cc = parse_arch(arch)
    failing = [w for c, w in reqs if cc < c]
    if failing:
        report.add("target arch", FAIL, f"{name} (sm_{cc}) cannot run: {'; '.join(failing)}")
    else:
        report.add("target arch", OK, f"{name} (sm_{cc}) runs {why or 'float weights'}")


# vLLM's Marlin weight-only kernels tile a rank's share of a linear in 64 output x 128 input blocks
# (GPTQ_MARLIN_MIN_THREAD_N / _K); its CUTLASS W8A8 / FP8 GEMMs need 16-aligned dimensions.
MARLIN_MIN_N, MARLIN_MIN_K, SCALED_MM_ALIGN = 64, 128, 16


def tp_partitions(config: ModelConfig, tp: int) -> list[tuple[str, str, int, int, int]]:
    """(vLLM's fused layer, first member, out per rank, in per rank, full in) of one decoder layer
    at tensor-parallel degree `tp`: q/k/v and gate/up are column-parallel (outputs split; KV heads
    replicated when tp exceeds them), o_proj and down_proj row-parallel (inputs split)."""
    d, h = config.head_dim, config.hidden_size
    kv_per_rank = max(1, config.num_kv_heads // tp)
    i = config.mlp_width
    mlp = config.mlp_prefixes[0]  # vLLM's fused MoE splits every expert alike
    return [
        ("qkv_proj", "self_attn.q_proj", (config.num_heads // tp + 2 * kv_per_rank) * d, h, h),
        ("o_proj", "self_attn.o_proj", h, config.num_heads * d // tp, config.num_heads * d),
        ("gate_up_proj", mlp + "gate_proj", 2 * i // tp, h, h),
        ("down_proj", mlp + "down_proj", h, i // tp, i),
    ]



def check_tensor_parallel(report: DoctorReport, plan: QuantizationPlan, config: ModelConfig, tp: int | None) -> None:
    """The splits vLLM makes at `--tensor-parallel-size tp`, and what its kernels need of each
    rank's share: whole heads per rank, whole quantization groups per rank (a group split across
    ranks has no scale), and the kernels' tile alignment."""
    if tp is None:
        return
    name = f"tensor parallel {tp}"
    heads = []
    if config.num_heads % tp:
        heads.append(f"{config.num_heads} attention heads are not divisible by {tp}")
    if config.num_kv_heads % tp and tp % config.num_kv_heads:
        heads.append(f"{config.num_kv_heads} KV heads neither divide by {tp} nor divide it (no replication)")
    if config.mlp_width % tp:
        heads.append(f"intermediate size {config.mlp_width} is not divisible by {tp}")
    if heads:
        report.add(name, FAIL, "; ".join(heads))
        return
    fails, warns = [], []
    for layer, member, n, k, full_k in tp_partitions(config, tp):
        s = plan.scheme_for(f"model.layers.0.{member}")
        if s is None:
            continue
        w = s.weights
        if s.input_activations is None and w.type == "int":
            group = w.group_size if w.strategy == "group" and w.group_size else full_k
            if group < full_k and k % group:
                fails.append(f"{layer}: {k} inputs per rank split its groups of {group}")
            if n % MARLIN_MIN_N or k % MARLIN_MIN_K:
                warns.append(f"{layer}: {n} x {k} per rank is not a multiple of {MARLIN_MIN_N} x {MARLIN_MIN_K}")
        elif n % SCALED_MM_ALIGN or k % SCALED_MM_ALIGN:
            fails.append(f"{layer}: {n} x {k} per rank is not 16-aligned for the W8A8/FP8 GEMM")
    if fails:
        report.add(name, FAIL, "; ".join(fails) + ": serve with a tensor-parallel size that divides them")
    elif warns:
        report.add(name, WARN, "; ".join(warns) + " (vLLM's Marlin kernels: releases without padding refuse "
                   "the layer, later ones pad it to the tile at some speed cost)")
    else:
        report.add(name, OK, f"heads, groups and kernel tiles split evenly over {tp} GPUs")


def check_kv_plan(report: DoctorReport, kv: QuantArgs | None, config: ModelConfig,
                  checkpoint: Any = None, calib_samples: int | None = None) -> None:
    if kv is None:
        report.add("kv cache", INFO, "not quantized (16-bit KV)")
        return
    from lmfoundry.model.kv_quant import check_kv_args

    try:
        per_head = check_kv_args(kv)
    except UserError as exc:
        report.add("kv cache", FAIL, str(exc))
        return
    kind = "fp8 e4m3" if kv.type == "float" else "int8"
    shape = f"[{config.num_kv_heads}, 1, 1] per KV head" if per_head else "[1] per tensor"
    if checkpoint is not None:
        missing = [f"model.layers.{i}.self_attn.{s}" for i in range(config.num_layers)
                   for s in ("k_scale", "v_scale") if not checkpoint.has(f"model.layers.{i}.self_attn.{s}")]
        if missing:
            report.add("kv scales", FAIL, f"kv_cache_scheme {kind} declared but {len(missing)} scale tensor(s) "
                       f"missing (first: {missing[0]}); runtimes would fall back to 1.0 and produce garbage")
        else:
            report.add("kv scales", OK, f"k_scale/v_scale {shape} present in all {config.num_layers} layers")
    else:
        if calib_samples is not None and calib_samples < 1:
            report.add("kv scales", FAIL, "KV scales are calibrated from data but calibration has no samples")
        else:
            report.add("kv scales", OK, f"{kind} k_scale/v_scale {shape}, calibrated per layer "
                       "(absmax of post-rotary K and V on the quantized layer)")
    if kv.type == "int":
        report.add("kv cache", WARN, "int8 KV runs in lmfoundry's runtime; vLLM's compressed-tensors KV cache "
                   "is fp8 only, so vLLM will not serve this KV scheme as int8")
    else:
        report.add("kv cache", OK, f"fp8 KV {'per head (attn_head)' if per_head else 'per tensor'} "
                   "(vLLM: kv_cache_scheme from the checkpoint)")


# ------------------------------------------------------------------------------------- memory
def _quant_spec(scheme: Scheme | None):
    from lmfoundry.capacity.arithmetic import QuantSpec

    if scheme is None:
        return QuantSpec("bf16", 16, "none")
    w = scheme.weights
    precision = "fp8" if w.type == "float" else f"int{w.num_bits}"
    strategy = w.strategy if w.strategy in ("tensor", "channel", "group") else "channel"
    return QuantSpec(precision, w.num_bits, strategy, group_size=w.group_size if strategy == "group" else None,
                     zero_points=not w.symmetric, g_idx=w.actorder == "dynamic")


def serving_bytes(config: ModelConfig, plan: QuantizationPlan, ctx: int) -> dict[str, int]:
    """GPU bytes to serve one sequence of `ctx` tokens: stored weights (16-bit non-linear parts)
    plus the KV cache; the activation workspace is not counted."""
    from lmfoundry.capacity.arithmetic import kv_bytes_per_token, weight_bytes

    scheme = plan.groups[0].scheme if plan.groups else None
    lm_head_quantized = plan.scheme_for("lm_head") is not None and not config.tie_word_embeddings
    weights = weight_bytes(config, _quant_spec(scheme), 1, lm_head_quantized)["total"]
    kv_dtype = "bf16" if plan.kv_cache is None else ("fp8" if plan.kv_cache.type == "float" else "int8")
    per_token = kv_bytes_per_token(config, kv_dtype, 1)
    return {"weights": weights, "kv_per_token": per_token, "kv_at_ctx": per_token * ctx, "ctx": ctx,
            "total": weights + per_token * ctx}


def check_memory(report: DoctorReport, config: ModelConfig, plan: QuantizationPlan, ctx: int,
                 gpu_mem: int | None, calib: dict[str, int] | None) -> None:
    serve = serving_bytes(config, plan, ctx)
    report.estimates["serving"] = serve
    detail = (f"weights {gib(serve['weights'])} + KV {serve['kv_per_token'] / 1024:.1f} KiB/token x {ctx} "
              f"= {gib(serve['total'])} for one {ctx}-token sequence")
    if gpu_mem is None:
        report.add("serving memory", INFO, detail)
    elif serve["weights"] > gpu_mem:
        report.add("serving memory", FAIL, f"weights alone ({gib(serve['weights'])}) exceed --gpu-mem {gib(gpu_mem)}")
    elif serve["total"] > gpu_mem:
        report.add("serving memory", FAIL, f"{detail} exceeds --gpu-mem {gib(gpu_mem)}")
    else:
        seqs = (gpu_mem - serve["weights"]) // max(1, serve["kv_at_ctx"])
        report.add("serving memory", OK, f"{detail}; about {seqs} such sequences fit in {gib(gpu_mem)} "
                   "(before activation workspace)")
    if calib is not None:
        report.estimates["calibration"] = calib
        phases = ("embedding_phase", "layer_phase", "total")
        report.add("calibration memory", INFO, f"peak about {gib(calib['total'])} per process on CPU "
                   f"(embedding phase {gib(calib['embedding_phase'])}, layer phase {gib(calib['layer_phase'])}: "
                   f"{', '.join(f'{k} {gib(v)}' for k, v in calib.items() if k not in phases and v)})")


# ------------------------------------------------------------------------------------- entry points
def _plan_report(config: ModelConfig, recipe: Recipe, subject: str) -> DoctorReport:
    q = recipe.quantize
    report = DoctorReport(subject or f"quantize with {q.method} {q.scheme}")
    report.add("model", INFO, f"{config.model_type}: {config.num_layers} layers, hidden {config.hidden_size}, "
               f"{config.num_heads} heads / {config.num_kv_heads} KV heads, head_dim {config.head_dim}")
    return report


GROUP_SIZE_OK = "divides every targeted linear"


def _scheme_detail(plan: QuantizationPlan) -> str:
    return "; ".join(f"{scheme_label(g.scheme)} -> {plan.format()}" for g in plan.groups)


def _method_detail(recipe: Recipe, plan: QuantizationPlan, quantizer: Quantizer) -> str:
    needs_data = quantizer.needs_calibration or plan.kv_cache is not None
    return (f"{recipe.quantize.method} produces {plan.groups[0].scheme.name}"
            f"{'' if needs_data else ' without calibration data'}")


def diagnose_plan(config: ModelConfig, recipe: Recipe, arch: str | None = None,
                  gpu_mem: int | None = None, ctx: int | None = None, subject: str = "",
                  tp: int | None = None, source_dtype: Any = "float32") -> DoctorReport:
    """Every check for quantizing a float model with `recipe`, building the plan and the quantizer
    as `quantize` does (lmfoundry.quantizers.from_recipe) but reporting a step that fails as a row
    instead of stopping; `source_dtype` is the stored dtype of the weights (it sizes the embedding
    table in memory)."""
    from lmfoundry.calibration.pipeline import check_plan
    from lmfoundry.quantizers.from_recipe import build_plan, build_quantizer, fit_plan

    report = _plan_report(config, recipe, subject)
    try:
        plan = fit_plan(build_plan(recipe.quantize), config)
    except UserError as exc:
        report.add("scheme", FAIL, str(exc))
        return report
    report.add("scheme", OK, _scheme_detail(plan))
    quantizer = None
    try:
        quantizer = build_quantizer(recipe.quantize, plan)
        report.add("method x scheme", OK, _method_detail(recipe, plan, quantizer))
    except UserError as exc:
        report.add("method x scheme", FAIL, str(exc))
    try:
        check_plan(plan, config)
        report.add("group size", OK, GROUP_SIZE_OK)
    except UserError as exc:
        report.add("group size", FAIL, str(exc))
    _plan_checks(report, config, plan, quantizer, recipe, arch, gpu_mem, ctx, tp, source_dtype)
    return report


def _plan_checks(report: DoctorReport, config: ModelConfig, plan: QuantizationPlan, quantizer: Quantizer | None,
                 recipe: Recipe, arch: str | None, gpu_mem: int | None, ctx: int | None, tp: int | None,
                 source_dtype: Any) -> None:
    """The checks of a built plan (schema, fused modules, tensor parallel, arch, KV cache, memory);
    without a quantizer (its method refused the scheme) calibration data is assumed needed."""
    from lmfoundry.calibration.memory import calibration_bytes
    from lmfoundry.quantformat.scheme import to_compressed_tensors

    q, c = recipe.quantize, recipe.calibration
    needs_data = quantizer is None or quantizer.needs_calibration or plan.kv_cache is not None
    try:
        to_compressed_tensors(plan)
        report.add("quantization_config", OK, "valid compressed-tensors schema")
    except Exception as exc:  # pydantic ValidationError and friends: the message is the finding
        first = str(exc).strip().splitlines()
        report.add("quantization_config", FAIL, f"compressed-tensors rejects the plan: {' '.join(first[:3])[:300]}")
    check_fused(report, plan, config)
    check_tensor_parallel(report, plan, config, tp)
    static = [g.scheme.name for g in plan.groups if g.scheme.needs_activation_calibration]
    if static:
        report.add("activations", INFO, "static per-tensor input_scale calibrated per linear (shared by fused linears)")
    check_arch(report, plan, arch)
    check_kv_plan(report, plan.kv_cache, config, None, c.num_samples if needs_data else None)
    calib = calibration_bytes(config, q.method, c.num_samples, c.seq_len, c.batch_size, needs_data, source_dtype)
    check_memory(report, config, plan, ctx or config.max_position_embeddings, gpu_mem, calib)


def diagnose_checkpoint(reader: Any, arch: str | None = None, gpu_mem: int | None = None,
                        ctx: int | None = None, tp: int | None = None) -> DoctorReport:
    """Checks for an existing compressed-tensors checkpoint (what a runtime will find)."""
    config = ModelConfig.from_dict(reader.config)
    plan: QuantizationPlan = reader.plan
    report = DoctorReport(f"checkpoint {reader.folder}")
    report.add("model", INFO, f"{config.model_type}: {config.num_layers} layers, format {plan.format()}")
    check_fused(report, plan, config)
    check_tensor_parallel(report, plan, config, tp)
    check_arch(report, plan, arch)
    check_kv_plan(report, plan.kv_cache, config, checkpoint=reader)
    check_memory(report, config, plan, ctx or config.max_position_embeddings, gpu_mem, None)
    return report


def diagnose(model: str, recipe: Recipe, arch: str | None = None, gpu_mem: int | None = None,
             ctx: int | None = None, allow_pickle: bool = False, tp: int | None = None) -> DoctorReport:
    """`lmfoundry doctor MODEL`: the checks of an existing checkpoint, or of quantizing a float
    model with `recipe`."""
    from lmfoundry.checkpoint.folder import CheckpointReader
    from lmfoundry.checkpoint.sources import resolve_model

    folder = resolve_model(model, allow_pickle=allow_pickle)
    reader = CheckpointReader(folder)
    if reader.plan is not None:
        return diagnose_checkpoint(reader, arch, gpu_mem, ctx, tp)
    config = ModelConfig.from_dict(reader.config)
    return diagnose_plan(config, recipe, arch, gpu_mem, ctx, subject=f"{model} -> {recipe.quantize.method} "
                         f"{recipe.quantize.scheme}", tp=tp, source_dtype=reader.dtype)


def preflight(config: ModelConfig, plan: QuantizationPlan, quantizer: Quantizer, recipe: Recipe,
              source_dtype: Any) -> DoctorReport:
    """Run at the start of `quantize` on the objects it built: the plan fitted to the model and
    checked against it (`check_plan`), and the quantizer validated for its schemes, so those rows
    are passed here, not recomputed. Raises UserError naming every blocking problem."""
    report = _plan_report(config, recipe, "")
    report.add("scheme", OK, _scheme_detail(plan))
    report.add("method x scheme", OK, _method_detail(recipe, plan, quantizer))
    report.add("group size", OK, GROUP_SIZE_OK)
    _plan_checks(report, config, plan, quantizer, recipe, None, None, None, None, source_dtype)
    if report.blocking:
        raise UserError("pre-flight checks failed (run `lmfoundry doctor` for the full table): "
                        + "; ".join(f"{c.name}: {c.detail}" for c in report.blocking))
    return report
