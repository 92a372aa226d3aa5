"""Many LoRA adapters served from one base model in the same batches (Punica / S-LoRA / vLLM's
multi-LoRA): each row of a step carries the slot of its request's adapter (-1: the base), and
every adapted product adds each row's own delta on top of whatever the base linear computed
(dense prepacked, int4/int8 packed, W8A8, FP8 ...), so it works on any base the engine serves.

`LoRAStack` holds the adapters' weights at every *site* of the model (a linear, or the fused
q/k/v or gate/up product of the CPU serving swap), stacked as `lmfoundry.kernels.lora` describes:
`a` [max_loras, parts * max_rank, in], `bt` [max_loras, max_rank, out] with each adapter's scale
folded in, zero padded. A wrapper of the site's module forward adds the step's deltas with one
gathered shrink and one expand (the C kernels of `runtime/cpu/native/lora.c` on CPU, the Triton ops on
a GPU, their PyTorch references where neither runs): one pass per step, not one per adapter. A
step with no adapter row adds nothing (one check per product).

`LoRAManager` is the engine's registry: adapter names -> slots, loading (`read_adapter` checks
an adapter against the base before anything is written) and unloading, and a key per load that
the prefix cache chains block hashes from, so KV computed under one adapter is never served to
another (or to the same name loaded again with other weights).
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, cast

import torch
from torch import nn

from lmfoundry.checkpoint.lora_adapter import LoRAAdapter, check_adapter, read_adapter
from lmfoundry.errors import UserError
from lmfoundry.model.config import FUSED_LINEARS, LAYER_LINEARS, ModelConfig
from lmfoundry.runtime.cpu.native.lora import LoRAKernels, load_lora_kernels
from lmfoundry.runtime.engine.engine_config import check_lora_slots_fit

if TYPE_CHECKING:
    from lmfoundry.model.reference import CausalLM

DEFAULT_MAX_RANK = 16  # vLLM's --max-lora-rank default


class AdapterInUse(UserError):
    """An unload refused because requests still run with the adapter (HTTP 409)."""


@dataclass
class LoRASite:
    """One product the deltas are added to: its key (the module, or the kernel model's GEMM
    name), the linears whose outputs it lays side by side (full names, in output order) and the
    adapters' stacked weights for it."""

    key: nn.Module | str
    names: tuple[str, ...]
    ends: torch.Tensor  # int32 [P]: each part's last output column + 1
    a: torch.Tensor  # [L, P * R, in]
    bt: torch.Tensor  # [L, R, out]

    @property
    def in_features(self) -> int:
        return int(self.a.shape[2])

    @property
    def out_features(self) -> int:
        return int(self.bt.shape[2])


def model_sites(model: nn.Module) -> list[tuple[nn.Module, tuple[str, ...]]]:
    """(module called in the forward, its linears) of every decoder layer of a reference
    `CausalLM`: a fused q/k/v or gate/up product where the CPU serving swap made one (`qkv_proj`,
    `gate_up_proj` set), else each linear itself."""
    out: list[tuple[nn.Module, tuple[str, ...]]] = []
    fused_of = {member: group for group, members in FUSED_LINEARS.items() for member in members}
    layers = cast(nn.ModuleList, model.get_submodule("model.layers"))
    for i, layer in enumerate(layers):
        done: set[str] = set()
        for local in LAYER_LINEARS:
            if local in done:
                continue
            group = fused_of.get(local)
            fused = layer.get_submodule(group) if group is not None and _has_fused(layer, group) else None
            members = FUSED_LINEARS[group] if fused is not None and group is not None else (local,)
            module = fused if fused is not None else layer.get_submodule(local)
            out.append((module, tuple(f"model.layers.{i}.{m}" for m in members)))
            done.update(members)
    return out


def _has_fused(layer: nn.Module, group: str) -> bool:
    parent, attr = group.rsplit(".", 1)
    return getattr(layer.get_submodule(parent), attr, None) is not None


def kernel_model_sites(model: Any) -> list[tuple[str, tuple[str, ...]]]:
    """(GEMM name, its linears) of every decoder layer of an engine bundle's `KernelModel`, as
    compile fused them."""
    out: list[tuple[str, tuple[str, ...]]] = []
    for layer in model.layers:
        for gemm in (*layer.qkv, layer.o_proj, *layer.gate_up, layer.down):
            prefix, local = gemm.name.split(".", 3)[:3], gemm.name.split(".", 3)[3]
            out.append((gemm.name, tuple(".".join([*prefix, m]) for m in FUSED_LINEARS.get(local, (local,)))))
    return out


Ops = tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]  # (shrink, expand) as kernels.lora has them


class LoRAStack:
    """Stacked adapter weights at every site of a model; `active(rows)` sets the step's
    row -> slot map for the forward it wraps. On a reference `CausalLM` (`on_model`) each site's
    module forward is wrapped to add the deltas; an engine bundle's `KernelModel` (`on_kernel_model`) calls `add` after
    each GEMM with its kernel set's ops."""

    def __init__(self, sites: list[tuple[nn.Module | str, tuple[str, ...]]], config: ModelConfig, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device | str = "cpu", ops: Ops | None = None) -> None:
        self.max_loras, self.max_rank, self.dtype, self.device = max_loras, max_rank, dtype, torch.device(device)
        self.rows: torch.Tensor | None = None
        # the slot every row runs outside a step's row map (`attach_adapter`: eval-gate's adapter-on-base
        # models), None: those rows run the base
        self.default_slot: int | None = None
        self.ops = ops
        shapes = config.linear_shapes
        dims: list[tuple[list[int], int]] = []  # each site's (part outputs, in features)
        for _key, names in sites:
            dims.append(([shapes[n.split(".", 3)[3]][0] for n in names], shapes[names[0].split(".", 3)[3]][1]))
        slot_bytes = max_rank * sum(len(outs) * k + sum(outs) for outs, k in dims) * dtype.itemsize
        check_slots_fit(max_loras, max_rank, slot_bytes, self.device)
        self.sites: list[LoRASite] = []
        self.where: dict[str, tuple[LoRASite, int]] = {}  # linear -> (site, part)
        for (key, names), (outs, k) in zip(sites, dims, strict=True):
            site = LoRASite(key, names, torch.tensor(outs, dtype=torch.int32).cumsum(0).to(torch.int32).to(device),
                            torch.zeros(max_loras, len(names) * max_rank, k, dtype=dtype, device=device),
                            torch.zeros(max_loras, max_rank, sum(outs), dtype=dtype, device=device))
            self.sites.append(site)
            for p, name in enumerate(names):
                self.where[name] = (site, p)
        self.by_key = {site.key: site for site in self.sites if isinstance(site.key, str)}
        kernels = load_lora_kernels() if self.device.type == "cpu" and ops is None else None
        self.kernels: LoRAKernels | None = kernels if kernels is not None and kernels.supports(dtype) else None
        if self.kernels is not None:
            for site in self.sites:
                self.kernels.check_stack(site.a, site.bt, site.ends)
        self._wrapped = [site.key for site in self.sites if isinstance(site.key, nn.Module)]
        for site in self.sites:
            if isinstance(site.key, nn.Module):
                self._wrap(site, site.key)

    @classmethod
    def on_model(cls, model: nn.Module, config: ModelConfig, max_loras: int, max_rank: int) -> "LoRAStack":
        causal_lm = cast("CausalLM", model)
        return cls(list(model_sites(model)), config, max_loras, max_rank, causal_lm.dtype, causal_lm.device)

    @classmethod
    def on_kernel_model(cls, model: Any, max_loras: int, max_rank: int) -> "LoRAStack":
        ks = model.kernels
        return cls(list(kernel_model_sites(model)), model.config, max_loras, max_rank, model.dtype, model.device,
                   ops=(ks.lora_shrink, ks.lora_expand))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.sites for t in (s.a, s.bt))

    def close(self) -> None:
        """Unwrap the modules (the model computes the base alone again)."""
        for module in self._wrapped:
            del module.forward  # the instance attribute set by _wrap: the class's forward again
        self._wrapped = []

    # ---- slots ------------------------------------------------------------------------------
    @torch.no_grad()
    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put `adapter` in `slot` (zero padded to the stack's rank, scales folded into B)."""
        self.clear(slot)
        r_max = self.max_rank
        for name, lin in adapter.linears.items():
            site, p = self.where[name]
            r = lin.rank
            lo = int(site.ends[p - 1]) if p else 0
            site.a[slot, p * r_max : p * r_max + r] = lin.a.to(self.dtype)
            site.bt[slot, :r, lo : int(site.ends[p])] = (lin.b * lin.scale).t().to(self.dtype)

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        for site in self.sites:
            site.a[slot].zero_()
            site.bt[slot].zero_()

    # ---- the step ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def active(self, rows: torch.Tensor | None) -> Iterator[None]:
        """Within the block, rows [T] int32 (a slot per row of the flat step, -1: base) select
        each row's adapter; None: every row runs the base."""
        self.rows = None if rows is None else rows.to(self.device, non_blocking=True)
        try:
            yield
        finally:
            self.rows = None

    @property
    def engaged(self) -> bool:
        """Whether a forward now adds deltas (a step's row map, or a default slot)."""
        return self.rows is not None or self.default_slot is not None

    def rows_for(self, n: int) -> torch.Tensor | None:
        """The slots of the n rows a product sees: the step's map, else the default slot's."""
        if self.rows is not None or self.default_slot is None:
            return self.rows
        return torch.full((n,), self.default_slot, dtype=torch.int32, device=self.device)

    def _wrap(self, site: LoRASite, module: nn.Module) -> None:
        """Give `module` an instance `forward` that adds the deltas after its own (the class's
        forward stays; `close` removes the wrapper). Not a forward hook: a module with hooks
        leaves PyTorch's fast call path, which at a decode step cost about as much as the deltas."""
        base = module.forward

        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            out = base(x, *args, **kwargs)
            rows = self.rows if self.rows is not None else self.rows_for(x.numel() // site.in_features)
            if rows is not None:
                self.apply(site, x, out, rows)
            return out

        module.forward = forward  # type: ignore[method-assign]

    def add(self, key: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += the deltas of GEMM `key` for its input x (a no-op unless `engaged`)."""
        site = self.by_key[key]
        rows = self.rows_for(x.numel() // site.in_features)
        if rows is not None:
            self.apply(site, x, y, rows)

    def apply(self, site: LoRASite, x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor) -> None:
        """y [.., out] += each row's delta for input x [.., in] (rows flattened in order)."""
        x2 = x.reshape(-1, site.in_features)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        y2 = y.view(-1, site.out_features)
        if x2.shape[0] != rows.shape[0]:
            raise RuntimeError(f"LoRA rows: {rows.shape[0]} slots for {x2.shape[0]} rows")
        x2 = x2.to(site.a.dtype)
        kernels = self.kernels
        if self.ops is not None:
            shrink, expand = self.ops
            expand(shrink(x2, site.a, rows), site.bt, rows, site.ends, y2)
        elif kernels is not None and y2.dtype == site.a.dtype:
            kernels.apply(x2, site.a, site.bt, rows, site.ends, y2)
        else:  # imported here: an engine without LoRA never loads Triton (tens of MiB resident)
            from lmfoundry.kernels import lora as lora_ops

            if y2.is_cuda:
                lora_ops.lora_expand(lora_ops.lora_shrink(x2, site.a, rows), site.bt, rows, site.ends, y2)
            else:
                s = lora_ops.shrink_reference(x2, site.a, rows)
                lora_ops.expand_reference(s, site.bt, rows, site.ends, y2)


@dataclass
class LoadedAdapter:
    name: str
    path: Path
    slot: int
    key: int  # unique per load: the prefix cache's chain root for its requests
    rank: int
    nbytes: int


def check_slots_fit(max_loras: int, max_rank: int, slot_bytes: int, device: torch.device) -> None:
    """The stack's slots against the memory free on `device` (the host's available memory on a
    CPU), before they are allocated (`engine_config.check_lora_slots_fit`)."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import psutil

        free = psutil.virtual_memory().available
    check_lora_slots_fit(max_loras, max_rank, slot_bytes, free, f"free on {device.type}")


@dataclass
class LoRAManager:
    """The engine's adapters: names -> slots of one `LoRAStack`, per-adapter request counts."""

    stack: LoRAStack
    base: ModelConfig
    adapters: dict[str, LoadedAdapter] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)  # requests added per adapter name, ever
    _keys: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    @classmethod
    def for_executor(cls, executor: Any, base: ModelConfig, max_loras: int, max_rank: int) -> "LoRAManager":
        """A manager whose stack serves the executor's model; refuses the paths LoRA does not run on."""
        if max_loras < 1 or max_rank < 1:
            raise UserError(f"--max-loras and --max-lora-rank must be at least 1, got {max_loras} and {max_rank}")
        if base.is_moe:
            raise UserError(f"LoRA on a mixture-of-experts base ({base.model_type}) is not implemented")
        name = getattr(executor, "name", type(executor).__name__)
        if name == "reference" and hasattr(executor, "lora"):
            stack = LoRAStack.on_model(executor.model, base, max_loras, max_rank)
        elif name == "kernels" and hasattr(executor, "lora"):
            built_rank = _check_bundle(executor.model, max_loras, max_rank)
            stack = LoRAStack.on_kernel_model(executor.model, max_loras, built_rank)  # the rank the kernels cover
            executor.model.lora = stack
        else:
            raise UserError(f"LoRA adapters run on one process (a checkpoint folder, an --arch cpu bundle, or a GPU "
                            f"bundle compiled with --max-loras); this engine runs {name!r}")
        executor.lora = stack
        return cls(stack, base)

    @property
    def max_loras(self) -> int:
        return self.stack.max_loras

    def load(self, name: str, path: str | Path) -> LoadedAdapter:
        """Read the adapter (refused in one line if it does not fit the base), then put it in a
        free slot. Raises UserError; nothing changes on refusal."""
        if not name or name != name.strip():
            raise UserError(f"adapter name {name!r}: a name without surrounding spaces is needed")
        if name in self.adapters:
            raise UserError(f"an adapter named {name!r} is already loaded (unload it first)")
        free = sorted(set(range(self.max_loras)) - {a.slot for a in self.adapters.values()})
        if not free:
            raise UserError(f"all {self.max_loras} adapter slots are in use (--max-loras {self.max_loras}); "
                            "unload one first")
        adapter = read_adapter(path, self.base, self.stack.max_rank)
        self.stack.write(free[0], adapter)
        loaded = LoadedAdapter(name, Path(path), free[0], next(self._keys), adapter.rank, adapter.nbytes())
        self.adapters[name] = loaded
        self.requests.setdefault(name, 0)
        return loaded

    def unload(self, name: str) -> None:
        loaded = self.adapters.pop(name)
        self.stack.clear(loaded.slot)

    def resolve(self, name: str) -> LoadedAdapter:
        try:
            adapter = self.adapters[name]
        except KeyError:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded") from None
        self.requests[name] = self.requests.get(name, 0) + 1
        return adapter


def _check_bundle(model: Any, max_loras: int, max_rank: int) -> int:
    """The rank an engine bundle's LoRA kernels were built for; refuses a bundle whose kernels
    cannot serve these adapters."""
    manifest = model.kernels.manifest
    record = manifest.get("lora")
    if record is None:
        raise UserError("this engine bundle has no LoRA kernels; compile it with `lmfoundry compile ... "
                        "--max-loras N --max-lora-rank R` to serve adapters on it")
    if max_loras > record["max_loras"] or max_rank > record["max_rank"]:
        raise UserError(f"the bundle's LoRA kernels serve --max-loras {record['max_loras']} and --max-lora-rank "
                        f"{record['max_rank']}, fewer than asked ({max_loras}, {max_rank}); compile it for more")
    if model.comm is not None:
        raise UserError("LoRA adapters with --tp are not implemented")
    if any(f["applied"] and f["kind"] == "act_order_fold" for f in manifest["fusions"]):
        raise UserError("LoRA on a bundle whose gate/up rows are stored in down_proj's act order is not implemented; "
                        "compile a checkpoint without act-order, or serve the checkpoint folder")
    return int(record["max_rank"])


def attach_adapter(executor: Any, base: ModelConfig, path: str | Path) -> LoadedAdapter:
    """Make one adapter run on every row of every forward of the executor's model, in the
    engine's steps and outside them (whole-window scoring calls the model directly): how
    eval-gate evaluates an adapter on a base. Refused in one line as `serve --lora` refuses it."""
    rank = check_adapter(path, base)
    manager = LoRAManager.for_executor(executor, base, 1, rank)
    loaded = manager.load("adapter", path)
    manager.stack.default_slot = loaded.slot
    return loaded


def step_rows(items: list[tuple[Any, int]]) -> torch.Tensor | None:
    """The slot of every row of a step (sequences in row order with their token counts), or None
    when every row runs the base."""
    if all(seq.lora_slot < 0 for seq, _ in items):
        return None
    return torch.tensor([seq.lora_slot for seq, n in items for _ in range(n)], dtype=torch.int32)
