"""The executor of an engine bundle's `KernelModel` (every op a compiled kernel: cubins on a
matching GPU, Triton JIT / interpreter, or each kernel's reference on CPU) and its decode CUDA
graphs. Kept apart from `executor.py` so that an engine serving the reference model never imports
the kernels and Triton behind `kernel_model`; `executor.local_executor` imports it for a KernelModel.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from lmfoundry.errors import UserError
from lmfoundry.kernels.spec import DIVISIBILITY
from lmfoundry.runtime.engine.engine_config import EngineConfig
from lmfoundry.runtime.engine.step_inputs import StepInputs, padded_table
from lmfoundry.runtime.kernel_model import AttentionInputs, KernelModel

if TYPE_CHECKING:
    from lmfoundry.runtime.engine.lora_adapters import LoRAStack

# A bundle's cubins were built assuming every pointer DIVISIBILITY-byte aligned (`kernels.spec`);
# the step's metadata travels as one int32 buffer whose parts the kernels take as slices, so each
# part starts at a multiple of this many int32s. A slice at another offset makes the launcher fall
# back to Triton JIT for that call.
ALIGN_INT32 = DIVISIBILITY // 4


def packed_starts(lengths: list[int]) -> list[int]:
    """Where each part of a packed int32 buffer starts (aligned), and at the end its length."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + -(-n // ALIGN_INT32) * ALIGN_INT32)
    return starts


def pack_int32(parts: list[list[int]]) -> torch.Tensor:
    """The parts in one int32 tensor, each at its `packed_starts` offset (zeros between)."""
    starts = packed_starts([len(p) for p in parts])
    flat = [0] * starts[-1]
    for p, at in zip(parts, starts, strict=False):
        flat[at : at + len(p)] = p
    return torch.tensor(flat, dtype=torch.int32)


def packed_views(buf: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """The parts of a `pack_int32` buffer (on any device) as views."""
    return [buf[at : at + n] for at, n in zip(packed_starts(lengths), lengths, strict=False)]


class KernelModelExecutor:
    """An engine bundle's kernels (see `kernel_model.py`). Step metadata goes to the device as one
    int32 buffer (one host-to-device copy per step), sliced into ids, positions, slots, tables, each
    slice aligned as the cubins assume (`pack_int32`)."""

    name = "kernels"

    def __init__(self, model: KernelModel, config: EngineConfig) -> None:
        if config.deterministic:
            raise UserError("--deterministic runs the CPU engine (a checkpoint folder); an engine bundle's compiled "
                            "kernels choose their tiles by the step's size")
        if config.block_size != model.kernels.manifest["kv_cache"]["block_size"]:
            raise UserError(f"the engine's kernels were built for KV blocks of "
                            f"{model.kernels.manifest['kv_cache']['block_size']} tokens, not --block-size "
                            f"{config.block_size}")
        self.model = model
        self.engine_config = config
        self.config = model.config
        self.dtype = model.dtype
        self.device = model.device
        self.caches: list = []
        self._graphs: DecodeGraphs | None = None
        self.context_limit = self.config.kernel_context_limit  # plain causal kernels: exact up to a window
        self.lora: LoRAStack | None = None  # set by the engine's LoRAManager (a bundle with LoRA kernels)

    def kv_bytes_per_token(self) -> int:
        cfg = self.config
        size = torch.empty((), dtype=self.model.cache_dtype()).element_size()
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * size

    def allocate(self, num_blocks: int) -> None:
        self.caches = self.model.allocate_cache(num_blocks, self.engine_config.block_size)

    def attention_inputs(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionInputs]:
        """(ids, positions, attention inputs) on the device from one packed int32 copy."""
        bs, nd = step.block_size, step.num_decode
        dec, pre = step.decode_items, step.prefill_items
        dec_width = max((-(-(c + 1) // bs) for c, _, _ in dec), default=0)
        pre_width = max((-(-(c + n) // bs) for c, n, _ in pre), default=0)
        cu = [0]
        for _, n, _ in pre:
            cu.append(cu[-1] + n)
        parts: list[list[int]] = [step.ids, step.positions, step.slots,
                                  [c + 1 for c, _, _ in dec], [x for _, _, t in dec for x in padded_table(t, dec_width)],
                                  cu if pre else [], [c + n for c, n, _ in pre],
                                  [x for _, _, t in pre for x in padded_table(t, pre_width)]]
        flat = pack_int32(parts)
        if self.device.type == "cuda":
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        ids, positions, slots, dec_lens, dec_tab, cu_t, pre_lens, pre_tab = packed_views(flat, [len(p) for p in parts])
        attn = AttentionInputs(
            slots=slots, num_decode=nd,
            decode_tables=dec_tab.view(len(dec), dec_width) if dec else None, decode_lens=dec_lens if dec else None,
            prefill_tables=pre_tab.view(len(pre), pre_width) if pre else None,
            cu_seqlens=cu_t if pre else None, prefill_lens=pre_lens if pre else None,
            max_q_len=max((n for _, n, _ in pre), default=0))
        return ids, positions, attn

    def forward(self, step: StepInputs) -> torch.Tensor:
        lora = self.lora
        if lora is not None and (step.lora_rows is not None or lora.default_slot is not None):
            ids, positions, attn = self.attention_inputs(step)  # the captured graphs hold no LoRA deltas
            with lora.active(step.lora_rows):
                return self.model.hidden_states(ids, positions, attn, self.caches)
        if self.graphs is not None and step.num_decode == len(step.items):
            hidden = self.graphs.run(step)
            if hidden is not None:
                return hidden
        ids, positions, attn = self.attention_inputs(step)
        return self.model.hidden_states(ids, positions, attn, self.caches)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    @property
    def graphs(self) -> "DecodeGraphs | None":
        if self._graphs is None and self.device.type == "cuda" and self.engine_config.cuda_graphs and self.caches:
            max_len = self.engine_config.max_model_len or self.context_limit
            self._graphs = DecodeGraphs(self, -(-max_len // self.engine_config.block_size))
        return self._graphs


GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class DecodeGraphs:
    """One CUDA graph per decode batch-size bucket, captured on first use: a step copies its
    metadata into the bucket's static int32 buffer (one host-to-device copy) and replays every
    kernel of the forward. Padding rows write no cache slot (slot -1) and attend to one token."""

    def __init__(self, executor: KernelModelExecutor, table_width: int) -> None:
        self.executor = executor
        self.width = table_width
        self.graphs: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.failed = ""

    def _host(self, step: StepInputs, bucket: int) -> torch.Tensor:
        assert step.block_size == self.executor.engine_config.block_size
        return graph_inputs(step, bucket, self.width).pin_memory()

    def _views(self, buf: torch.Tensor, bucket: int) -> tuple[torch.Tensor, torch.Tensor, AttentionInputs]:
        return graph_views(buf, bucket, self.width)

    def _capture(self, step: StepInputs, bucket: int) -> None:
        ex = self.executor
        buf = self._host(step, bucket).to(ex.device)
        ids, pos, attn = self._views(buf, bucket)
        stream = torch.cuda.Stream(ex.device)
        stream.wait_stream(torch.cuda.current_stream(ex.device))
        with torch.cuda.stream(stream):  # warm-up: loads cubins / JIT-compiles outside the capture
            ex.model.hidden_states(ids, pos, attn, ex.caches)
        torch.cuda.current_stream(ex.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = ex.model.hidden_states(ids, pos, attn, ex.caches)
        self.graphs[bucket] = (graph, buf, hidden)

    def run(self, step: StepInputs) -> torch.Tensor | None:
        """Hidden states of a decode-only step by graph replay; None when no bucket fits (or
        capture failed once: then every step runs eagerly, with one log line)."""
        b = len(step.items)
        bucket = next((x for x in GRAPH_BUCKETS if x >= b), None)
        if bucket is None or self.failed or any(-(-(c + 1) // step.block_size) > self.width for c, _, _ in step.items):
            return None
        if bucket not in self.graphs:
            try:
                self._capture(step, bucket)
            except Exception as exc:  # a kernel that cannot be captured: fall back to eager steps
                self.failed = str(exc)
                logging.getLogger("lmfoundry.engine").warning("CUDA graph capture failed (%s); decoding eagerly",
                                                              exc)
                return None
        graph, buf, hidden = self.graphs[bucket]
        buf.copy_(self._host(step, bucket), non_blocking=True)
        graph.replay()
        return hidden[:b]


def graph_inputs(step: StepInputs, bucket: int, width: int) -> torch.Tensor:
    """A decode-only step's metadata padded to `bucket` rows (a CUDA graph's static buffer, on the
    host): ids, positions, slots, context lengths, then `bucket` block-table rows of `width`.
    Padding rows write no cache slot (-1) and attend to one token."""
    pad = bucket - len(step.items)
    rows = [padded_table(t, width) for _, _, t in step.items] + [[0] * width] * pad
    return pack_int32([step.ids + [0] * pad, step.positions + [0] * pad, step.slots + [-1] * pad,
                       [c + 1 for c, _, _ in step.items] + [1] * pad, [x for r in rows for x in r]])


def graph_views(buf: torch.Tensor, bucket: int, width: int) -> tuple[torch.Tensor, torch.Tensor, AttentionInputs]:
    """(ids, positions, attention inputs) as views of a `graph_inputs` buffer (on the device)."""
    ids, pos, slots, lens, table = packed_views(buf, [bucket] * 4 + [bucket * width])
    return ids, pos, AttentionInputs(slots, bucket, table.view(bucket, width), lens, None, None, None, 0)
