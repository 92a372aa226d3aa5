"""The sequential layer-wise pipeline every quantization method runs in.

No tracing and no full model in memory: the decoder is rebuilt one layer at a time from the
safetensors memory maps. For each layer in order we (1) load its float weights, (2) let the
quantizer calibrate it on the hidden states entering it, (3) quantize its linears, (4) run it
again to produce the next layer's inputs (from the quantized or the float layer), (5) write its
tensors to the output shard, and (6) release it. Peak memory is one layer plus the calibration
activations.

Methods whose linears need only their own inputs' statistics (GPTQ: `Quantizer.sequential`)
fuse (2)-(4) into one pass that stops before each group of linears sharing an input, quantizes
the group, and goes on with the quantized weights: half the forward work of a float pass plus a
quantized pass, and each linear is fitted to the inputs it will see after quantization.
"""

from __future__ import annotations

import contextlib
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from tqdm.auto import tqdm

from lmfoundry.calibration.journal import LayerJournal
from lmfoundry.checkpoint.folder import CheckpointReader, CheckpointWriter, checkpoint_names, encode_linear
from lmfoundry.distributed import ranks
from lmfoundry.errors import UserError
from lmfoundry.heap import release_free_heap
from lmfoundry.model.attention_math import RotaryEmbedding
from lmfoundry.model.config import ModelConfig
from lmfoundry.model.reference import DecoderLayer, ExpertCalibration, SparseMoE
from lmfoundry.model.reference import embed as embed_rows
from lmfoundry.quantformat.qmath import all_finite, check_group_size
from lmfoundry.quantformat.scheme import QuantizationPlan, Scheme
from lmfoundry.quantizers.base import LayerCalibration, LayerResult, Quantizer, weight_error
from lmfoundry.quantizers.output_error import OutputErrorMeter

Propagate = Literal["quantized", "float"]


def _proc_status(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far. VmHWM belongs to this process image, while
    getrusage's ru_maxrss survives fork/exec and would report a parent's peak."""
    hwm = _proc_status("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    rss = _proc_status("VmRSS")
    return rss if rss is not None else peak_rss_bytes()


@dataclass
class PipelineReport:
    layers: dict[str, Any] = field(default_factory=dict)
    layer_seconds: dict[str, float] = field(default_factory=dict)  # wall time of each decoder layer
    warnings: list[str] = field(default_factory=list)
    peak_rss_bytes: int = 0
    wall_s: float = 0.0


def layer_schemes(plan: QuantizationPlan, config: ModelConfig, layer_idx: int) -> dict[str, Scheme]:
    """Local linear name -> scheme for one decoder layer (ignored/untargeted linears omitted)."""
    out = {}
    for local in config.linear_shapes:
        scheme = plan.scheme_for(f"model.layers.{layer_idx}.{local}")
        if scheme is not None:
            out[local] = scheme
    return out


def check_plan(plan: QuantizationPlan, config: ModelConfig) -> None:
    """Fail before any work if a group size does not divide a targeted linear's input dimension,
    or if a checkpoint that stores q/k/v and gate/up fused (Phi-3) would need one tensor per part
    (per-tensor weight scales, dynamic act-order)."""
    if config.checkpoint_fused:
        for group in plan.groups:
            w = group.scheme.weights
            if w.strategy == "tensor" or w.actorder == "dynamic":
                raise UserError(f"{config.model_type} stores q/k/v and gate/up fused, which holds one weight scale "
                                f"per tensor and one g_idx: use per-channel or group weights without dynamic "
                                f"act-order (got {w.describe()})")
    names = [f"model.layers.{i}.{local}" for i in range(config.num_layers) for local in config.linear_shapes]
    unmatched = plan.unmatched(names + ["lm_head"])
    if unmatched:
        raise UserError(f"target {unmatched[0]!r} matches no linear of this {config.model_type} model "
                        f"(its linears are named like model.layers.0.{next(iter(config.linear_shapes))}); "
                        "nothing would be quantized by it")
    if not any(plan.scheme_for(n) is not None for n in names):
        raise UserError("the targets and ignore list leave no linear of the model to quantize")
    for local, (_, in_features) in config.linear_shapes.items():
        for i in range(config.num_layers):
            scheme = plan.scheme_for(f"model.layers.{i}.{local}")
            if scheme is None or scheme.weights.strategy != "group":
                continue
            assert scheme.weights.group_size is not None  # QuantArgs requires one for "group"
            g = int(scheme.weights.group_size)
            if in_features % g:
                dims = sorted({k for _, k in config.linear_shapes.values()})
                ok = [s for s in (32, 64, 128, 256) if all(d % s == 0 for d in dims)]
                why = (f"is larger than the input dimension {in_features} of {local} (a group is a run of input "
                       "columns sharing one scale)" if g > in_features else
                       f"does not divide the input dimension {in_features} of {local}")
                raise UserError(
                    f"group size {g} {why}; "
                    f"group sizes that divide every layer: {', '.join(map(str, ok)) or 'none of 32/64/128/256'}"
                    " (or use --per-channel)"
                )
            break


def check_tensors_match_config(reader: CheckpointReader, config: ModelConfig) -> None:
    """The layer count and the embedding's shape that config.json declares are the tensors'
    (read from the safetensors headers, nothing loaded): a wrong num_hidden_layers or vocab_size
    would otherwise quantize part of a model, or fail inside a layer."""
    from lmfoundry.checkpoint.headers import read_safetensors_header

    n = config.num_layers
    if not any(k.startswith(f"model.layers.{n - 1}.") for k in reader.index):
        present = sorted({int(k.split(".")[2]) for k in reader.index if k.startswith("model.layers.")})
        raise UserError(f"{reader.folder}: config.json declares num_hidden_layers {n} but the checkpoint holds "
                        f"{len(present)} decoder layer(s)")
    if any(k.startswith(f"model.layers.{n}.") for k in reader.index):
        raise UserError(f"{reader.folder}: the checkpoint holds more than the {n} decoder layers config.json declares")
    name = "model.embed_tokens.weight"
    if name in reader.index and name not in reader.virtual and name not in reader.stored:
        shape = read_safetensors_header(reader.index[name])[name]["shape"]
        want = [config.vocab_size, config.hidden_size]
        if list(shape) != want:
            raise UserError(f"{reader.folder}: {name} has shape {list(shape)}, but config.json's vocab_size and "
                            f"hidden_size imply {want}")


def load_layer(reader: CheckpointReader, config: ModelConfig, idx: int, dtype: torch.dtype,
               device: torch.device | None = None, experts: ExpertCalibration = "all") -> DecoderLayer:
    """Build decoder layer `idx` with its weights on `device` (moved in the stored dtype, then
    widened there: half the transfer of widening first), nothing else of the model. An MoE layer
    runs its experts on the calibration tokens as `experts` says (`SparseMoE.calibrate_experts`)."""
    with torch.device("meta"):
        layer = DecoderLayer(config, idx)
    expected = layer.state_dict()
    stored = reader.prefixed(f"model.layers.{idx}")
    for k, v in stored.items():  # what the config implies, before any arithmetic on it
        name = f"model.layers.{idx}.{k}"
        if k in expected and tuple(v.shape) != tuple(expected[k].shape):
            raise UserError(f"{reader.folder}: {name} is stored with shape {list(v.shape)}, but config.json implies "
                            f"{list(expected[k].shape)}")
        if k in expected and not v.is_floating_point():
            raise UserError(f"{reader.folder}: {name} is stored as {str(v.dtype).removeprefix('torch.')}, not a "
                            "float type; a float model is expected here")
        if v.is_floating_point() and not all_finite(v):
            bad = int((~torch.isfinite(v)).sum())
            raise UserError(f"{reader.folder}: {name} holds {bad} non-finite value(s) (inf or NaN); refusing to "
                            "quantize it (its scales would be inf or NaN)")
    state = {k: v.to(device).to(dtype) for k, v in stored.items()}
    missing = set(expected) - set(state)
    if missing:
        raise UserError(f"{reader.folder}: layer {idx} lacks {sorted(missing)[:3]}")
    layer.load_state_dict(state, assign=True, strict=False)
    if isinstance(layer.mlp, SparseMoE):
        layer.mlp.calibrate_experts = experts
    return layer.eval()


def _sequential_layer(layer: DecoderLayer, schemes: dict[str, Scheme], quantizer: Quantizer,
                      calib: LayerCalibration, idx: int, work_dtype: torch.dtype) -> LayerResult:
    """Calibrate and quantize one layer in a single pass, group by group (see
    `LayerCalibration.run_sequential`); leaves the layer's outputs in `calib.inputs`."""
    hooks = quantizer.calibration_hooks(layer, schemes, idx)
    result = LayerResult({})
    meter = OutputErrorMeter(layer, list(schemes), len(calib.inputs), calib.num_tokens)

    def observe(group: tuple[str, ...], x: torch.Tensor) -> None:
        members = [n for n in group if n in schemes]
        if members and members[0] in hooks:
            hooks[members[0]](x)

    def finish(group: tuple[str, ...]) -> None:
        quantizer.quantize_group(layer, group, schemes, idx, result)
        for name in group:
            if name in result.weights:
                meter.quantized(name, _weight(layer, name))
                layer.get_submodule(name).weight.data = result.weights[name].dequantize(work_dtype)

    with torch.no_grad():
        calib.inputs = calib.run_sequential(layer, observe, finish)
    _record_output_errors(result, meter.finish())
    return result


def _weight(layer: torch.nn.Module, name: str) -> torch.Tensor:
    """The float weight of linear `name` of `layer`, before its codes replace it."""
    weight = layer.get_submodule(name).weight
    assert isinstance(weight, torch.Tensor)
    return weight.data


def _two_pass_layer(layer: DecoderLayer, schemes: dict[str, Scheme], quantizer: Quantizer,
                    calib: LayerCalibration | None, idx: int, work_dtype: torch.dtype, propagate: Propagate,
                    extra_layer_passes: list[Any]) -> tuple[LayerResult, dict[str, Any]]:
    """A float pass (outputs, plus the quantizer's statistics through its hooks), the quantizer,
    then a pass through the quantized layer: the output error metric and the next layer's inputs."""
    hooks = quantizer.calibration_hooks(layer, schemes, idx) if calib is not None else {}
    float_out = calib.run(layer, hooks=hooks, keep_outputs=True) if calib is not None else None
    with torch.no_grad():
        result: LayerResult = quantizer.quantize_layer(layer, schemes, calib, idx)
        meter = (OutputErrorMeter(layer, list(result.weights), len(calib.inputs), calib.num_tokens)
                 if calib is not None else None)
        for name, qw in result.weights.items():
            if meter is not None:  # the float weight the method quantized (after any smoothing folded in)
                meter.quantized(name, _weight(layer, name))
            layer.get_submodule(name).weight.data = qw.dequantize(work_dtype)
        for fn in extra_layer_passes:  # run on the quantized layer
            fn(layer, calib, idx, result)
    metrics: dict[str, Any] = {}
    if calib is not None:
        q_out = calib.run(layer, keep_outputs=True)
        assert float_out is not None and meter is not None  # made above whenever calib is
        _record_output_errors(result, meter.finish())
        err = [weight_error(f, q) for f, q in zip(float_out, q_out, strict=True)]
        group = ranks()  # the mean over every rank's batches
        metrics["output_rel_error"] = group.sum_number(sum(err)) / group.sum_number(len(err))
        calib.inputs = q_out if propagate == "quantized" else float_out
    return result, metrics


def _record_output_errors(result: LayerResult, errors: dict[str, float]) -> None:
    """Each linear's output error (quantizers/output_error.py) into its metrics, next to
    its weight error."""
    for name, err in errors.items():
        result.weights[name].metrics["output_rel_error"] = err


def calibration_batches(calib_ids: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """This rank's calibration batches: the single-process batches, shared out contiguously
    among data-parallel ranks (re-cut into one batch per rank when there are fewer batches than
    ranks). Refused when there are fewer samples than ranks: a rank without data has no
    statistics to contribute."""
    group = ranks()
    batches = list(calib_ids.split(batch_size))
    if group.parallel:
        if calib_ids.shape[0] < group.world_size:
            raise UserError(f"{calib_ids.shape[0]} calibration samples cannot be shared by "
                            f"{group.world_size} ranks; use --num-samples >= {group.world_size}")
        if len(batches) < group.world_size:
            batches = list(calib_ids.tensor_split(group.world_size))
    return group.shard(batches)


@dataclass(frozen=True)
class PipelineOptions:
    """How the layer-by-layer pipeline executes (the recipe's calibration settings and the job's
    placement), apart from what it quantizes: each rank of a data-parallel job runs the same
    options over its own share of the batches.

    `extra_layer_passes` are callables `(layer, calib, layer_idx, result)` run after the quantizer
    on each layer (e.g. KV-cache scale calibration) that may add to `result.extra_tensors`.
    `device` is where layers, activations and statistics live (default CPU); with `offload` the
    activations stay in host memory between uses (see `LayerCalibration`). `experts` says which
    calibration tokens an MoE layer's experts see ("all" of them, or the "routed" ones; see
    `SparseMoE`)."""

    propagate: Propagate = "quantized"
    batch_size: int = 8
    extra_layer_passes: tuple[Any, ...] = ()
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    offload: bool = False
    experts: ExpertCalibration = "all"
    progress: bool = True


def run_pipeline(
    reader: CheckpointReader,
    plan: QuantizationPlan,
    quantizer: Quantizer,
    calib_ids: torch.Tensor | None,
    out_dtype: torch.dtype,
    options: PipelineOptions,
    writer: CheckpointWriter | None = None,
    journal: LayerJournal | None = None,
) -> PipelineReport:
    """Quantize every decoder layer of `reader`'s model into `writer`; returns per-layer metrics.

    With a `journal`, each finished layer is recorded (its shard, the activations entering the
    next layer) and a journal that already holds k layers makes the run continue at layer k.
    Under torchrun every rank runs this on its share of the batches (`calibration_batches`) and
    only the writer rank passes a `writer` (the others pass None and write nothing).

    `calib_ids` given to a data-free method (RTN) are run through each layer only to measure each
    linear's output error (quantizers/output_error.py); the quantize job passes none then, as the
    forward passes are what such a method is chosen to avoid.
    """
    t0 = time.time()
    config = ModelConfig.from_dict(reader.config)
    device, propagate, experts = options.device, options.propagate, options.experts
    extra_layer_passes = list(options.extra_layer_passes)
    report = PipelineReport()
    quantizer.scale_dtype = out_dtype
    work_dtype = torch.float32  # calibrate in fp32 whatever the storage dtype
    needs_data = quantizer.needs_calibration or bool(extra_layer_passes)
    if needs_data and calib_ids is None:
        raise UserError(f"method {quantizer.name} needs calibration data")
    needs_data = calib_ids is not None  # a data-free method given data runs it only to measure output errors
    if writer is None and not needs_data:
        return report  # a non-writing rank of a job without calibration data has no share of work

    start = journal.done if journal is not None else 0
    calib: LayerCalibration | None = None
    if start:  # resumed: shards of layers < start and the activations entering `start` are on disk
        assert journal is not None  # start > 0 only comes from a journal
        inputs = journal.restore(writer, report)
    else:  # --- embeddings: inputs of layer 0
        embed = reader.get(["model.embed_tokens.weight"])["model.embed_tokens.weight"]
        if writer is not None:
            writer.write_shard(_shard(0, config), {"model.embed_tokens.weight": embed.to(out_dtype)})
        if needs_data:  # rows gathered in the stored dtype, then widened (exact): no float32 copy of the table
            # (Gemma's sqrt(hidden) factor applied in the stored dtype too, as the served model does)
            assert calib_ids is not None  # refused above otherwise
            inputs = [embed_rows(config, embed, b).to(work_dtype)
                      for b in calibration_batches(calib_ids, options.batch_size)]
        del embed
    if needs_data:
        assert calib_ids is not None  # refused above otherwise
        positions = torch.arange(calib_ids.shape[1]).unsqueeze(0)
        cos, sin = RotaryEmbedding(config)(positions, work_dtype)
        stored = torch.device("cpu") if options.offload else device
        inputs = [x.to(stored) for x in inputs]
        calib = LayerCalibration(inputs, cos.to(device), sin.to(device), device=device, offload=options.offload)
    # once, after the embeddings: not between layers, where every layer needs what the one before
    # freed, so trimming would only make each layer fault its working set in again (same peak)
    release_free_heap()

    quantizer.calib = calib  # one object for the whole run: its inputs advance layer by layer
    bar = tqdm(range(start, config.num_layers), desc=f"{quantizer.name} layers", unit="layer", initial=start,
               total=config.num_layers, disable=not options.progress)
    sequential = calib is not None and quantizer.sequential and propagate == "quantized" and not extra_layer_passes
    for idx in bar:
        t_layer = time.time()
        # factory calls of quantizers and observers land on `device` too (CPU is already the default,
        # and the mode would add a Python hook to every op)
        with torch.device(device) if device.type != "cpu" else contextlib.nullcontext():
            layer = load_layer(reader, config, idx, work_dtype, device, experts)
            schemes = layer_schemes(plan, config, idx)
            if sequential:  # one pass, group by group; no float outputs, so no layer output error
                assert calib is not None  # `sequential` requires it
                result = _sequential_layer(layer, schemes, quantizer, calib, idx, work_dtype)
                layer_metrics: dict[str, Any] = {}
            else:
                result, layer_metrics = _two_pass_layer(layer, schemes, quantizer, calib, idx, work_dtype,
                                                        propagate, extra_layer_passes)
        layer_metrics.update({n: qw.metrics for n, qw in result.weights.items()})
        layer_metrics.update(result.metrics)
        report.warnings += [f"layer {idx}: {w}" for w in result.warnings]
        if writer is not None:
            # a temporary, not a name: the shard's tensors, allocated last, would pin the heap's top
            # through the next layer and keep glibc from reusing what this layer freed (a higher peak)
            writer.write_shard(_shard(idx + 1, config),
                               checkpoint_names(_layer_tensors(layer, idx, result, schemes, out_dtype), config))
        report.layers[f"model.layers.{idx}"] = layer_metrics
        report.layer_seconds[f"model.layers.{idx}"] = round(time.time() - t_layer, 3)
        del layer, result
        if journal is not None:
            journal.record(idx + 1, writer, report, calib.inputs if calib is not None else None)
        bar.set_postfix(rss=f"{peak_rss_bytes() / 2**20:.0f}MiB")

    if writer is None:
        report.wall_s = time.time() - t0
        return report
    # --- final norm and LM head
    tail = {"model.norm.weight": reader.get(["model.norm.weight"])["model.norm.weight"].to(out_dtype)}
    head_scheme = plan.scheme_for("lm_head")
    # a tied head that is quantized becomes a tensor of its own (the embedding stays as it is: a
    # lookup reads one row a token, the head every row each step); `quantized_config` unties it
    head_source = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    if head_scheme is not None or not config.tie_word_embeddings:
        w = reader.get([head_source])[head_source]
        if head_scheme is None:
            tail["lm_head.weight"] = w.to(out_dtype)
        else:
            from lmfoundry.quantizers.rtn import rtn_quantize_weight

            check_group_size("lm_head", w.shape[1], head_scheme.weights)
            qw = rtn_quantize_weight(w.float(), head_scheme.weights, out_dtype)
            tail.update(encode_linear("lm_head", qw, head_scheme))
            report.layers["lm_head"] = {"lm_head": qw.metrics, "method": "rtn (no calibration for lm_head)"}
        del w
    writer.write_shard(_shard(config.num_layers + 1, config), tail)
    report.peak_rss_bytes = peak_rss_bytes()
    report.wall_s = time.time() - t0
    return report


def _shard(i: int, config: ModelConfig) -> str:
    n = config.num_layers + 2
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _layer_tensors(layer: DecoderLayer, idx: int, result: LayerResult, schemes: dict[str, Scheme],
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{idx}"
    out: dict[str, torch.Tensor] = {}
    quantized = set(result.weights)
    for name, t in layer.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if module in quantized and name.endswith(".weight"):
            continue
        out[f"{prefix}.{name}"] = t.to(dtype)
    for name, qw in result.weights.items():
        out.update(encode_linear(f"{prefix}.{name}", qw, schemes[name]))
    for name, t in result.extra_tensors.items():
        out[f"{prefix}.{name}"] = t
    return {k: v.cpu() for k, v in out.items()}  # no-op on CPU; the shard is written from host memory
