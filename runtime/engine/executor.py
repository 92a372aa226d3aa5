"""How a scheduled step's flat inputs become hidden states: the two model executors.

- `ReferenceModelExecutor`: the PyTorch reference `CausalLM` (the model every stage shares) with
  attention over the engine's paged cache through `PagedAttention` (CPU serving, eval on CPU).
- `KernelModelExecutor` (`kernel_executor.py`, imported only for one): an engine bundle's
  `KernelModel`, every op a compiled kernel (cubins on a matching GPU, Triton JIT / interpreter,
  or each kernel's reference on CPU).

`ModelRunner` builds one `StepInputs` per step (rows ordered decodes first) and hands it to its
executor; an executor owns its KV cache tensors and turns the step into what its ops need.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any, cast

import torch

from lmfoundry.errors import UserError
from lmfoundry.runtime.cpu.batch_invariant import DeterminismUnavailable, make_batch_invariant
from lmfoundry.runtime.cpu.dense_linears import can_prepack, prepack_dense_linears
from lmfoundry.runtime.cpu.elementwise import swap_native_elementwise
from lmfoundry.runtime.cpu.native.paged_decode import PagedDecode, load_paged_decode
from lmfoundry.runtime.cpu.native.paged_prefill import PagedPrefill, load_paged_prefill
from lmfoundry.runtime.cpu.weight_only_linears import CProductLinear, Int4PackLinear, Int8PackLinear, prepack_c_products
from lmfoundry.runtime.engine.attention import Chunk, DecodeBatch, DecodeGroup, PagedAttention, PrefillBatch
from lmfoundry.runtime.engine.engine_config import EngineConfig
from lmfoundry.runtime.engine.kv_cache import KVCacheLayers, resolve_kv_formats
from lmfoundry.runtime.engine.step_inputs import ModelExecutor, StepInputs, padded_table

if TYPE_CHECKING:
    from lmfoundry.model.reference import CausalLM, DecoderLayer
    from lmfoundry.runtime.engine.lora_adapters import LoRAStack

CASCADE_MIN_TOKENS = 64  # shared-prefix length from which decode attention is split (cascade)


class ReferenceModelExecutor:
    """The reference `CausalLM` over the engine's `KVCacheLayers` (float, INT8 or FP8 storage)."""

    name = "reference"

    def __init__(self, model: CausalLM, config: EngineConfig) -> None:
        self.model = model.eval()
        self.deterministic = config.deterministic
        on_cpu = model.device.type == "cpu"
        if self.deterministic:
            self._check_deterministic(model, on_cpu)
        elif can_prepack(model.dtype) and on_cpu:
            # serving-time module swap: oneDNN reorders each weight once; q/k/v and gate/up run as
            # one product each
            prepack_dense_linears(model, fuse=True)
            prepack_c_products(model, fuse=True)  # 4/8-bit codes: widened once per block of rows (C)
            packed = (CProductLinear, Int4PackLinear, Int8PackLinear)
            quantized = [m for m in model.modules() if isinstance(m, packed)]
            if quantized:  # from how many rows each runs dequantized, timed on this machine
                from lmfoundry.runtime.cpu.crossover import set_dense_rows

                set_dense_rows(quantized)
            if swap_native_elementwise(model):  # RMSNorm, SiLU(gate) * up and rotary: one C pass each
                from lmfoundry.runtime.cpu.crossover import set_silu_mul_from

                set_silu_mul_from(model)  # from which size the SiLU pass beats PyTorch's ops, timed here
        self.engine_config = config
        self.config = model.config
        self.dtype = model.dtype
        self.formats = resolve_kv_formats(model, config.kv_cache_dtype)
        # this process's KV heads: all of them, or a tensor-parallel rank's share
        self.kv_heads = cast("DecoderLayer", model.model.layers[0]).self_attn.num_kv_heads
        self.cache: KVCacheLayers | None = None
        self.context_limit = self.config.max_position_embeddings  # sliding windows honoured via AttentionSpec
        # an `--arch cpu` bundle's AOT-compiled step (runtime.cpu.compiled_step), over at most
        # `compiled_max_tokens` tokens a step; None: the eager reference model
        self.compiled_step = getattr(model, "compiled_step", None)
        self.compiled_max_tokens = int(getattr(model, "compiled_max_tokens", 0))
        self.compiled_steps = 0
        self.eager_released = False  # `release_eager_linears`: only the compiled step can run a step
        self.decode_kernel = self._decode_kernel(model)
        self.prefill_kernel = None if self.deterministic else self._prefill_kernel()
        if self.deterministic and self.decode_kernel is None:
            raise UserError(f"--deterministic: {self._no_decode_kernel()}")
        self.lora: LoRAStack | None = None  # set by the engine's LoRAManager: adapters over this model

    def _check_deterministic(self, model: CausalLM, on_cpu: bool) -> None:
        """The deterministic mode's module swap (`batch_invariant.py`), or one line saying why
        this model cannot run it."""
        if not on_cpu:
            raise UserError("--deterministic runs the CPU engine; this model is on another device")
        if getattr(model, "compiled_step", None) is not None:
            raise UserError("--deterministic runs the eager model: an --arch cpu bundle's compiled step chooses "
                            "its kernels by the step's size; serve the checkpoint it was compiled from")
        try:
            make_batch_invariant(model)
        except DeterminismUnavailable as exc:
            raise UserError(f"--deterministic: {exc}") from None

    def _no_decode_kernel(self) -> str:
        """Why the in-place decode kernel does not run this model (the deterministic mode needs it)."""
        if self.config.needs_attention_spec:
            return f"{self.config.model_type} attention (its own scale, soft-cap or windows) has no batch-invariant kernel"
        if not all(f.lossless for f in self.formats):
            return ("a KV cache stored quantized or in another dtype than the model's has no batch-invariant "
                    "attention kernel; use --kv-cache-dtype auto")
        from lmfoundry.runtime.cpu.native.build import unavailable_reason

        return f"the C attention kernel is not available ({unavailable_reason('paged_decode') or 'this head size'})"

    def _decode_kernel(self, model: CausalLM) -> PagedDecode | None:
        """The in-place C decode kernel, where it applies: a CPU model without a layer-specific
        attention (Gemma's scale, soft-cap, windows), a float cache in the compute dtype, and a
        C compiler on the machine. Otherwise the step's decodes are gathered in groups."""
        if self.config.needs_attention_spec or model.device.type != "cpu":
            return None
        if not all(f.lossless and PagedDecode.supports(f.storage_dtype, self.config.head_dim) for f in self.formats):
            return None
        kernel = load_paged_decode()
        if kernel is None:
            from lmfoundry.runtime.cpu.native.build import unavailable_reason

            logging.getLogger("lmfoundry.engine").info("decode attention gathers the KV blocks (no C kernel: %s)",
                                                      unavailable_reason("paged_decode"))
        return kernel

    def _prefill_kernel(self) -> PagedPrefill | None:
        """The in-place C prefill kernel, where the decode kernel runs (same conditions) and the
        cache is bf16 with a head_dim it takes; otherwise chunks go through SDPA."""
        if self.decode_kernel is None:
            return None
        attention = cast("DecoderLayer", self.model.model.layers[0]).self_attn
        group = attention.num_heads // max(1, attention.num_kv_heads)
        if not all(PagedPrefill.supports(f.storage_dtype, self.config.head_dim, group) for f in self.formats):
            return None
        return load_paged_prefill()

    def kv_bytes_per_token(self) -> int:
        return sum(f.bytes_per_token(self.kv_heads, self.config.head_dim) for f in self.formats)

    def allocate(self, num_blocks: int) -> None:
        self.cache = KVCacheLayers(self.formats, num_blocks, self.engine_config.block_size, self.kv_heads,
                                  self.config.head_dim)

    @property
    def round_trips(self) -> list:
        return [getattr(layer.self_attn, "kv_round_trip", None) for layer in self.model.model.layers]

    def _shared_blocks(self, tables: torch.Tensor) -> int:
        """Leading blocks every decode sequence shares, when enough to pay for a cascade split.
        Shared block ids are prefix-cache hits: full blocks, and never the block being written."""
        if tables.shape[0] < 2 or not self.engine_config.cascade_attention:
            return 0
        same = (tables == tables[:1]).all(dim=0)
        shared = int(torch.cumprod(same.to(torch.int64), 0).sum())
        return shared if shared * self.engine_config.block_size >= CASCADE_MIN_TOKENS else 0

    def _decode_groups(self, step: StepInputs) -> list[list[int]]:
        """The step's decodes (indices into decode_items) grouped for attention: sequences whose
        tables start with the same block share a cached prompt prefix and attend it once as a
        cascade group; the rest form one plain group. Grouping also pads each group only to its
        own longest sequence."""
        n = step.num_decode
        if not n:
            return []
        if not self.engine_config.cascade_attention:
            return [list(range(n))]
        by_first: dict[int, list[int]] = {}
        for i, (_, _, table) in enumerate(step.decode_items):
            by_first.setdefault(table[0] if table else -1, []).append(i)
        groups = [g for g in by_first.values() if len(g) > 1]
        rest = sorted(i for g in by_first.values() if len(g) == 1 for i in g)
        return groups + [rest] if rest else groups

    def _decode_batch(self, step: StepInputs) -> DecodeBatch | None:
        """The step's decodes as one batch for the C kernel (rows 0..num_decode-1)."""
        n = step.num_decode
        if not n:
            return None
        assert self.decode_kernel is not None
        lengths = [c + 1 for c, _, _ in step.decode_items]
        width = max(-(-length // step.block_size) for length in lengths)
        tables = torch.tensor([padded_table(t, width) for _, _, t in step.decode_items], dtype=torch.int32)
        return DecodeBatch(self.decode_kernel, tables, torch.tensor(lengths, dtype=torch.int32),
                           torch.arange(n, dtype=torch.int32), max(lengths))

    def _prefill_batch(self, step: StepInputs) -> PrefillBatch | None:
        """The step's chunks as one batch for the C prefill kernel."""
        items = step.prefill_items
        if not items:
            return None
        assert self.prefill_kernel is not None
        width = max(-(-(c + n) // step.block_size) for c, n, _ in items)
        return PrefillBatch(self.prefill_kernel,
                            torch.tensor([padded_table(t, width) for _, _, t in items], dtype=torch.int32),
                            torch.tensor(step.offsets[step.num_decode :], dtype=torch.int32),
                            torch.tensor([n for _, n, _ in items], dtype=torch.int32),
                            torch.tensor([c for c, _, _ in items], dtype=torch.int32))

    def _chunks(self, step: StepInputs) -> list[Chunk]:
        """The step's chunks for SDPA, each with the blocks and mask its cached context needs."""
        bs = step.block_size
        lossless = all(f.lossless for f in self.formats)
        chunks = []
        for (c, n, table), row in zip(step.prefill_items, step.offsets[step.num_decode :], strict=True):
            if c == 0 and lossless:
                chunks.append(Chunk(row, row + n, 0, None, None))
                continue
            blocks = torch.tensor(table[: -(-(c + n) // bs)], dtype=torch.long)
            mask = torch.arange(c + n)[None, :] <= (c + torch.arange(n))[:, None] if c > 0 else None
            chunks.append(Chunk(row, row + n, c, blocks, mask))
        return chunks

    def _invariant_batch(self, step: StepInputs) -> DecodeBatch:
        """Every row of the step as one query of the decode kernel (the deterministic mode): row j
        of an item with c cached tokens attends the first c + j + 1 tokens of its sequence, read
        from the cache after the step's K/V are written, whether it is a decode or a prompt token."""
        assert self.decode_kernel is not None
        lengths = [length for c, n, _ in step.items for length in range(c + 1, c + n + 1)]
        width = max(-(-(c + n) // step.block_size) for c, n, _ in step.items)
        tables = torch.tensor([padded_table(t, width) for _, _, t in step.items], dtype=torch.int32)
        tables = tables.repeat_interleave(torch.tensor([n for _, n, _ in step.items]), dim=0)
        return DecodeBatch(self.decode_kernel, tables, torch.tensor(lengths, dtype=torch.int32),
                           torch.arange(len(lengths), dtype=torch.int32), max(lengths), batch_invariant=True)

    def forward(self, step: StepInputs) -> torch.Tensor:
        bs = step.block_size
        if self.deterministic:
            assert self.cache is not None, "allocate() the KV cache first"
            context = PagedAttention(self.cache, self.round_trips, torch.tensor(step.slots, dtype=torch.long), [], [],
                                     self._invariant_batch(step))
            return self.model.hidden_states(torch.tensor(step.ids, dtype=torch.long),
                                            torch.tensor(step.positions, dtype=torch.long), context)
        prefill = self._prefill_batch(step) if self.prefill_kernel is not None else None
        chunks = self._chunks(step) if prefill is None else []
        decodes: list[DecodeGroup] = []
        batch = self._decode_batch(step) if self.decode_kernel is not None else None
        groups = self._decode_groups(step) if batch is None else []
        decode_items = step.decode_items
        for members in groups:
            items = [decode_items[i] for i in members]
            lengths = torch.tensor([c + 1 for c, _, _ in items])
            width = -(-int(lengths.max()) // bs)
            tables = torch.tensor([padded_table(t, width) for _, _, t in items], dtype=torch.long)
            real = torch.arange(width * bs)[None, :] < lengths[:, None]
            in_order = len(groups) == 1 and not chunks
            rows = None if in_order else torch.tensor(members, dtype=torch.long)
            decodes.append(DecodeGroup(rows, tables, real[:, None, None, :], self._shared_blocks(tables)))
        assert self.cache is not None, "allocate() the KV cache first"
        context = PagedAttention(self.cache, self.round_trips, torch.tensor(step.slots, dtype=torch.long), decodes,
                                 chunks, batch, prefill)
        ids = torch.tensor(step.ids, dtype=torch.long)
        positions = torch.tensor(step.positions, dtype=torch.long)
        lora = self.lora
        if lora is not None and (step.lora_rows is not None or lora.default_slot is not None):
            # the adapters wrap the eager model's linears, not a compiled step's
            with lora.active(step.lora_rows):
                return self.model.hidden_states(ids, positions, context)
        if self.compiled_step is not None and len(step.ids) <= self.compiled_max_tokens:
            self.compiled_steps += 1
            return self.compiled_step(self.model, ids, positions, context)
        if self.eager_released:
            raise RuntimeError(f"a step of {len(step.ids)} tokens needs the eager model, whose linears were released "
                               f"for the compiled step (at most {self.compiled_max_tokens} tokens, no LoRA)")
        return self.model.hidden_states(ids, positions, context)

    def release_eager_linears(self, max_step_tokens: int) -> int:
        """Drop the eager decoder linears of an `--arch cpu` bundle's model when its compiled step
        takes every step this engine can schedule (at most `max_step_tokens` tokens, within the
        step's size; no LoRA, whose adapters wrap the eager linears): the package holds its own
        copy of those weights, so keeping the eager one would hold them twice. Returns how many
        linears were released (0: the eager model may still run, nothing is dropped). Callers
        that also call the model directly (eval's whole-window scoring) must not ask."""
        from lmfoundry.runtime.cpu.compiled_step import release_decoder_linears

        if self.compiled_step is None or self.lora is not None or max_step_tokens > self.compiled_max_tokens:
            return 0
        self.eager_released = True
        return release_decoder_linears(self.model)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden).float()


def is_kernel_model(model: Any) -> bool:
    """Whether `model` is an engine bundle's `KernelModel`, asked without importing that module: one
    exists only once its module is imported, and an engine serving the reference model never
    imports it, nor the Triton kernels behind it (tens of MiB resident, never launched on a CPU)."""
    kernel_model = sys.modules.get("lmfoundry.runtime.kernel_model")
    return kernel_model is not None and isinstance(model, kernel_model.KernelModel)


def local_executor(model: Any, config: EngineConfig) -> ModelExecutor:
    """The executor of a model this process holds whole (or its rank's share of): a `KernelModel`
    runs its bundle's kernels, anything else (the reference `CausalLM`) the PyTorch reference
    path. A `ShardedModel` spanning rank processes runs `ranks.TensorParallelExecutor` instead
    (`model_runner.make_executor`)."""
    if is_kernel_model(model):
        from lmfoundry.runtime.engine.kernel_executor import KernelModelExecutor

        return KernelModelExecutor(model, config)
    return ReferenceModelExecutor(model, config)
