"""The quantizer interface the layer-wise pipeline drives.

A quantizer receives one decoder layer (float weights, in memory), the calibration inputs of that
layer and the scheme of each of its linears, and returns quantized tensors. It may also rewrite
other tensors of the layer (SmoothQuant and AWQ fold scales into norms) and add extra tensors
(KV-cache scales). It never sees the whole model: that is what keeps peak memory at one layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, cast

import torch
from torch import nn

from lmfoundry.errors import UserError
from lmfoundry.model.config import GATE_UP, QKV
from lmfoundry.model.reference import MLP, DecoderLayer, SparseMoE
from lmfoundry.quantformat.quantized_weight import QuantizedWeight
from lmfoundry.quantformat.scheme import Scheme


@dataclass
class LayerResult:
    """What a quantizer returns for one layer."""

    weights: dict[str, QuantizedWeight]  # local linear name ("self_attn.q_proj") -> codes
    extra_tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # local name -> tensor
    metrics: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


class LayerCalibration:
    """The calibration inputs of one decoder layer and a way to run them through it.

    `inputs` are the hidden states entering the layer, one tensor [B, T, H] per batch; `cos`/`sin`
    are the rotary tables for those positions (same for every batch: calibration samples share
    one length).

    With `offload` the hidden states live in host memory (pinned where CUDA is present) and each
    batch goes to `device` only while it runs: for calibration sets larger than the GPU has room
    for next to a layer. Without it, `load`/`store` are the identity, so the CPU path and a GPU
    whose memory holds the activations run exactly the same operations.
    """

    def __init__(self, inputs: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                 device: torch.device | None = None, offload: bool = False) -> None:
        self.inputs, self.cos, self.sin = inputs, cos, sin
        self.device = device if device is not None else cos.device
        self.offload = offload

    def load(self, x: torch.Tensor) -> torch.Tensor:
        """A stored batch where the layer computes (asynchronous from pinned memory)."""
        return x.to(self.device, non_blocking=True) if self.offload else x

    def store(self, y: torch.Tensor) -> torch.Tensor:
        """A computed batch where batches are kept (host memory when offloading)."""
        if not self.offload:
            return y
        host = torch.empty(y.shape, dtype=y.dtype, device="cpu", pin_memory=torch.cuda.is_available())
        return host.copy_(y)

    @property
    def num_tokens(self) -> int:
        return sum(x.shape[0] * x.shape[1] for x in self.inputs)

    @torch.no_grad()
    def run(self, layer: nn.Module, hooks: dict[str, Callable[[torch.Tensor], None]] | None = None,
            keep_outputs: bool = False) -> list[torch.Tensor]:
        """Forward every batch through `layer`; `hooks` maps a submodule name to a callback that
        receives that submodule's input for each batch."""
        handles = []
        for name, fn in (hooks or {}).items():
            module = layer.get_submodule(name)
            handles.append(module.register_forward_hook(lambda m, a, out, fn=fn: fn(a[0])))
        outputs = []
        try:
            for x in self.inputs:
                y = layer(self.load(x), self.cos, self.sin)
                if keep_outputs:
                    outputs.append(self.store(y))
        finally:
            for h in handles:
                h.remove()
        return outputs

    @torch.no_grad()
    def run_sequential(
        self,
        layer: DecoderLayer,
        observe: Callable[[tuple[str, ...], torch.Tensor], None],
        finish: Callable[[tuple[str, ...]], None],
    ) -> list[torch.Tensor]:
        """One pass through a decoder layer that stops at each group of linears sharing an input.

        For each group in layer order (q/k/v, o, gate/up, down), `observe(group, x)` sees the
        group's input for every batch, then `finish(group)` may replace the group's weights
        (quantize them) before any batch runs through them. So every linear is calibrated on the
        inputs the already-quantized linears before it produce ("true sequential" GPTQ), and the
        layer outputs are the quantized layer's, without a second pass. Each step's inputs are
        freed batch by batch as its outputs are made, so the peak stays at two hidden-sized lists
        plus the MLP's intermediate one. Consumes `self.inputs` (returns the new hidden states in
        their place).
        """
        attn, mlp = layer.self_attn, layer.mlp
        load, store = self.load, self.store

        def step(group: tuple[str, ...], inputs: list[torch.Tensor], fn: Callable) -> list[torch.Tensor]:
            """Observe `group`'s input of every batch, let it be quantized, then run it: each
            input is replaced in its list by fn(i, input), so it is freed as its output is made."""
            for x in inputs:
                observe(group, load(x))
            finish(group)
            for i, x in enumerate(inputs):
                inputs[i] = fn(i, load(x))
            return inputs

        hs, self.inputs = self.inputs, []  # the residual stream, updated in place
        normed = [store(layer.input_layernorm(load(x))) for x in hs]
        heads = step(QKV, normed,
                     lambda i, x: store(attn.heads_output(x, self.cos, self.sin)))
        # attn_residual/mlp_residual: the identity, or Gemma's norm on the branch output
        step(("self_attn.o_proj",), heads, lambda i, a: hs[i].add_(store(layer.attn_residual(attn.o_proj(a)))))
        normed = [store(layer.mlp_norm(load(h))) for h in hs]
        if isinstance(mlp, SparseMoE):
            self._experts_sequential(mlp, layer.mlp_prefixes, normed, hs, step)
            return hs
        mids = step(GATE_UP, normed, lambda i, x: store(mlp.hidden(x)))
        step(("mlp.down_proj",), mids, lambda i, m: hs[i].add_(store(layer.mlp_residual(mlp.down_proj(m)))))
        return hs

    def _experts_sequential(self, moe: SparseMoE, layer_prefixes: tuple[str, ...], normed: list[torch.Tensor],
                            hs: list[torch.Tensor], step: Callable) -> None:
        """The sequential pass through a sparse MoE block: the router (float) picks each token's
        experts once, then expert by expert its gate/up group sees that expert's tokens (every
        token under `calibrate_experts`), is quantized, runs, and likewise its down_proj; the
        routed outputs, weighted, add into the residual stream."""
        load, store = self.load, self.store
        routes = [moe.route(load(x).reshape(-1, x.shape[-1])) for x in normed]
        for e, module in enumerate(moe.experts):
            expert = cast(MLP, module)  # a ModuleList of MLPs (its items are typed as Module)
            picked = [moe.expert_tokens(chosen, e) for chosen, _ in routes]
            flats = [load(x).reshape(-1, x.shape[-1]) for x in normed]
            tokens = [flat if every else flat[rows] for flat, (rows, _, every) in zip(flats, picked, strict=True)]
            del flats
            prefix = layer_prefixes[e]
            # `step` runs these closures before the next expert: binding the loop's values is exact
            mids = step((prefix + "gate_proj", prefix + "up_proj"), tokens,
                        lambda i, x, expert=expert: expert.hidden(x))

            def add(i: int, m: torch.Tensor, expert: MLP = expert, picked: list = picked) -> torch.Tensor:
                rows, slots, every = picked[i]
                y = expert.down_proj(m)
                y = y[rows] if every else y
                flat = hs[i].view(-1, hs[i].shape[-1])
                flat.index_add_(0, rows.to(flat.device), store((y * routes[i][1][rows, slots, None]).to(flat.dtype)))
                return m.new_empty(0)  # this expert's intermediate is freed batch by batch

            step((prefix + "down_proj",), mids, add)


class Quantizer(ABC):
    """A quantization algorithm, known by `name` to the methods' table (methods.py)."""

    name: str = ""
    needs_calibration: bool = True  # must the pipeline run calibration data through each layer?
    scale_dtype: torch.dtype = torch.float32  # dtype of stored scales; set by the pipeline

    # The `--option` keys a method takes; set by subclasses, checked here (None: the subclass checks).
    known_options: tuple[str, ...] | None = None

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options = dict(options or {})
        if self.known_options is not None:
            unknown = set(self.options) - set(self.known_options)
            if unknown:
                raise UserError(f"{self.name}: unknown option(s) {', '.join(sorted(unknown))}; "
                                f"known: {', '.join(sorted(self.known_options))}")

    def flag(self, key: str, default: bool) -> bool:
        """A boolean option: recipes give YAML booleans, `--option k=false` JSON ones; the strings
        "true"/"false" (any case) are accepted too."""
        value = self.options.get(key, default)
        return value.strip().lower() in ("1", "true", "yes") if isinstance(value, str) else bool(value)

    def validate(self, scheme: Scheme) -> None:  # noqa: B027 - a no-op default: most methods take every scheme
        """Refuse a scheme this method cannot produce (before any work)."""

    def calibration_hooks(
        self, layer: DecoderLayer, schemes: dict[str, Scheme], layer_idx: int
    ) -> dict[str, Callable[[torch.Tensor], None]]:
        """Callbacks (submodule name -> fn(input)) the pipeline attaches during its float pass over
        the layer, so statistics cost no extra pass. Default: none."""
        return {}

    # The calibration of the layer in flight (rotary tables, batches), set by the pipeline before
    # `calibration_hooks`; a hook that needs more than its own input (GPTQ's attention weights)
    # reads it from here.
    calib: LayerCalibration | None = None

    # A method whose linears depend only on their own inputs (GPTQ) sets this and implements
    # `quantize_group`: the pipeline then calibrates and quantizes each layer in one sequential
    # pass (`LayerCalibration.run_sequential`) instead of a float pass plus a quantized pass.
    sequential: bool = False

    def quantize_group(self, layer: DecoderLayer, group: tuple[str, ...], schemes: dict[str, Scheme],
                       layer_idx: int, result: "LayerResult") -> None:
        """Quantize the linears of one input group (statistics from `calibration_hooks`) into
        `result`; only for `sequential` methods."""
        raise NotImplementedError(f"{self.name} does not quantize group by group")

    @abstractmethod
    def quantize_layer(
        self, layer: DecoderLayer, schemes: dict[str, Scheme], calib: LayerCalibration | None, layer_idx: int
    ) -> LayerResult:
        """Quantize the linears named in `schemes` (local names). May modify `layer` in place
        (e.g. fold smoothing scales into norms) but must leave its function in float unchanged
        except for quantization itself."""


def construct(cls: type[Quantizer], options: dict[str, Any] | None = None) -> Quantizer:
    """`cls(options)`, where an option of the wrong type is the user's error (its constructor
    only parses options: float("banana")). The methods' table (methods.py) and a method that
    builds another (SmoothQuant's GPTQ) construct through here."""
    try:
        return cls(options)
    except (TypeError, ValueError) as exc:
        shown = ", ".join(f"{k}={v!r}" for k, v in (options or {}).items())
        raise UserError(f"{cls.name}: an option has a value of the wrong type ({shown}): {exc}") from None


def get_linear(layer: nn.Module, name: str) -> nn.Linear:
    """The linear `name` (a local name, "self_attn.q_proj") of `layer`: `get_submodule` is typed
    as returning any Module, whose attributes torch types as `Tensor | Module`."""
    return cast(nn.Linear, layer.get_submodule(name))


def weight_error(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """Relative Frobenius error of a reconstructed weight: ||W - Ŵ|| / ||W||."""
    return float((w.float() - w_hat.float()).norm() / w.float().norm().clamp_min(1e-30))
