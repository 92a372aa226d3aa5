"""Dense bfloat16 linears laid out once, at the serving swap, for the product they run on CPU.

`prepack_dense_linears` is the runtime's module swap for the dense bf16 linears of a CPU model:
each becomes a `PrepackedLinear` (oneDNN's blocked layout, with the few-row C product's copy for
decode steps where it is built, or the AVX2 FMA panels where the CPU has no bf16 arithmetic);
q/k/v and gate/up become one `FusedPrepackedLinear` each, their linears left in place as
`PrepackedPart`s; a token embedding tied to the LM head reads its rows from the head's few-row
copy (`BlockedEmbedding`) instead of keeping a third copy of the table. The weight-only quantized
linears have their own swap (`weight_only_linears`).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence, TypeGuard, cast

import torch
from torch import nn

from lmfoundry.model.config import FUSED_LINEARS
from lmfoundry.runtime.cpu.features import onednn_bf16
from lmfoundry.runtime.cpu.native.bf16_fma_gemm import Bf16FmaGemm, load_bf16_fma_gemm
from lmfoundry.runtime.cpu.native.bf16_gemv import Bf16Gemv, load_bf16_gemv

MAX_ROWS_ANY = 2**31 - 1  # a C product that serves every row count


class PrepackedLinear(nn.Module):
    """A dense bfloat16 linear whose weight is laid out once, at the swap, for the product it runs.

    `F.linear` on a plain bf16 weight makes oneDNN reorder it on every call; for the small layers
    of a decode step that reorder costs about as much as the product (the weight-streaming rate
    of a plain call is well below the machine's; benchmarks/results/step_profile.md). vLLM's CPU
    backend prepacks the same way. Two layouts, by what the CPU has:

    - oneDNN with bf16 kernels: the weight reordered into oneDNN's blocked layout; outputs equal
      `F.linear`'s bit for bit, except for inputs of at most `bf16_gemv.MAX_ROWS` rows (decode
      steps) where the C product `lmfoundry.runtime.cpu.native.bf16_gemv` is built: oneDNN streams a
      weight well below the memory's rate there, the C kernel reads its own blocked copy front to
      back (outputs then differ from `F.linear`'s by the summation order: fp32 accumulation, one
      bf16 rounding).
    - no bf16 arithmetic (AVX2 CPUs, where oneDNN emulates bf16 several times slower than float32):
      the weight in the panels of `lmfoundry.runtime.cpu.native.bf16_fma_gemm`, which serves every row
      count with float32 FMAs on weights widened in registers (same arithmetic, one copy of the
      weight).

    With `batch_invariant` (the engine's deterministic mode) every row count runs one C product,
    the few-row one where the shape fits it (else the FMA panels, on any AVX2 CPU): each output is
    accumulated in one fixed order whatever the number of rows beside it, where oneDNN chooses its
    kernel, and so its summation order, by the row count. Only that product's copy is kept.

    The packed weight is opaque: this module is for serving, not for tracing (`compile --arch cpu`
    traces the plain model); `.weight` unpacks a copy."""

    gemv: Bf16Gemv | Bf16FmaGemm | None
    packed: torch.Tensor | None  # oneDNN's layout (None: the C product only)
    blocked: torch.Tensor | None  # the C product's layout of the weight

    def __init__(self, linear: nn.Linear, few_rows: bool = True, batch_invariant: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias.detach().contiguous() if linear.bias is not None else None
        self.row_limit = MAX_ROWS_ANY
        fma = None if onednn_bf16() else load_bf16_fma_gemm()
        if batch_invariant and fma is None:
            gemv = load_bf16_gemv()
            if gemv is not None and Bf16Gemv.fits(self.out_features, self.in_features):
                self.packed = None
                self.gemv, self.blocked = gemv, Bf16Gemv.block(linear.weight)
                return
            fma = load_bf16_fma_gemm()
            if fma is None:
                raise ValueError("no batch-invariant bf16 product on this CPU (it needs AVX2 and FMA)")
        if fma is not None:
            self.packed = None
            self.gemv, self.blocked = fma, fma.block(linear.weight)
            return
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        gemv = load_bf16_gemv() if few_rows else None
        fits = gemv is not None and Bf16Gemv.fits(self.out_features, self.in_features)
        self.gemv = gemv if fits else None
        self.blocked = Bf16Gemv.block(linear.weight) if fits else None  # the few-row product's copy
        self.row_limit = gemv.max_rows if gemv is not None and fits else 0

    @property
    def batch_invariant(self) -> bool:
        """Whether every row count runs the C product (one summation order for any batch)."""
        return self.packed is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and self.blocked is not None and x.numel() <= self.row_limit * self.in_features:
            rows = x.reshape(-1, self.in_features)
            rows = rows if rows.stride(1) == 1 else rows.contiguous()
            out = rows.new_empty(rows.shape[0], self.out_features)
            self.gemv(rows, self.blocked, self.bias, out)
            return out.view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @property
    def weight(self) -> torch.Tensor:
        """The plain [out, in] weight, unpacked on demand (a copy: nothing dense is kept)."""
        if self.packed is None:
            assert self.gemv is not None and self.blocked is not None  # the C product's copy: the only one
            return self.gemv.unblock(self.blocked, self.out_features).contiguous()
        return self.packed.to_dense()

    def extra_repr(self) -> str:
        layout = "oneDNN-prepacked" if self.packed is not None else \
            "FMA panels" if isinstance(self.gemv, Bf16FmaGemm) else "blocked for the C product"
        return f"in={self.in_features}, out={self.out_features}, bf16 {layout}"


class FusedPrepackedLinear(PrepackedLinear):
    """Linears that read the same input (q/k/v, gate/up) as one prepacked product.

    With one decode token a product streams its weight once, and each call also pays oneDNN's
    fixed dispatch cost; one call over the weights concatenated along the output dimension pays it
    once (vLLM's qkv_proj and gate_up_proj; the speed-up is in benchmarks/results/step_profile.md).
    Every output element is the same dot product as in the separate linear, so outputs equal theirs
    up to the GEMM's summation order. `parts` hands back each linear's output as a view."""

    def __init__(self, linears: Sequence[nn.Linear], few_rows: bool = True, batch_invariant: bool = False) -> None:
        first = linears[0]
        whole = nn.Linear(first.in_features, sum(lin.out_features for lin in linears), bias=first.bias is not None,
                          device="meta")
        whole.weight = nn.Parameter(torch.cat([lin.weight.detach() for lin in linears]), requires_grad=False)
        if first.bias is not None:
            whole.bias = nn.Parameter(torch.cat([lin.bias.detach() for lin in linears if lin.bias is not None]),
                                      requires_grad=False)
        super().__init__(whole, few_rows, batch_invariant)
        self.sizes = [lin.out_features for lin in linears]

    def parts(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each linear's output [..., out_i]: views of the one product (strided, not copied)."""
        return self(x).split(self.sizes, dim=-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fused {self.sizes}"


class PrepackedPart(nn.Module):
    """One linear of a `FusedPrepackedLinear`, left under its own name (q_proj, up_proj, ...) so
    that code calling or reading that linear alone keeps working after the swap. The parent's
    forward calls the fused module instead; calling a part runs the whole fused product and keeps
    its block. `.weight` is a copy (as `PrepackedLinear`'s), `.bias` a view of the fused bias."""

    fused: FusedPrepackedLinear

    def __init__(self, fused: FusedPrepackedLinear, index: int) -> None:
        super().__init__()
        self.__dict__["fused"] = fused  # not a submodule: the parent holds it (qkv_proj, gate_up_proj)
        self.index = index
        self.in_features, self.out_features = fused.in_features, fused.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.parts(x)[self.index]

    @property
    def weight(self) -> torch.Tensor:
        return self.fused.weight.split(self.fused.sizes)[self.index].clone()

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self.fused.bias is None else self.fused.bias.split(self.fused.sizes)[self.index]

    def extra_repr(self) -> str:
        return f"part {self.index} of the fused linear, in={self.in_features}, out={self.out_features}"


def can_prepack(dtype: torch.dtype) -> bool:
    """Whether dense linears of a CPU model running in `dtype` can be prepacked: bf16, on a CPU
    whose oneDNN has bf16 kernels or where the FMA product (`bf16_fma_gemm`) is built."""
    if dtype != torch.bfloat16:
        return False
    return onednn_bf16() or load_bf16_fma_gemm() is not None


def _prepackable(module: object) -> TypeGuard[nn.Linear]:
    """A plain `nn.Linear` (not a quantized, LoRA or other subclass) with a bf16 weight on CPU."""
    return type(module) is nn.Linear and module.weight.dtype == torch.bfloat16 \
        and module.weight.device.type == "cpu"


FEW_ROW_COPY_SHARE = 4  # the few-row product's weight copies may take 1/4 of the available memory


def _available_memory() -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _few_row_copies(model: nn.Module) -> bool:
    """Whether the dense bf16 linears get the few-row product's blocked copy: where it is built
    (and oneDNN serves the rest), and the copies (one more weight each) fit in a quarter of the
    available memory."""
    if load_bf16_gemv() is None or not onednn_bf16():
        return False
    extra = sum(m.weight.numel() * 2 for m in model.modules() if _prepackable(m))
    available = _available_memory()
    if available is not None and extra * FEW_ROW_COPY_SHARE > available:
        logging.getLogger("lmfoundry.runtime").info(
            "decode linears stay on oneDNN: the few-row product's weight copies (%.1f GiB) would take more than "
            "1/%d of the available memory", extra / 2**30, FEW_ROW_COPY_SHARE)
        return False
    return True


def _fuse_groups(model: nn.Module, few_rows: bool, batch_invariant: bool = False) -> int:
    """Swap each group of `FUSED_LINEARS` for one `FusedPrepackedLinear` where the group's parent
    reads the fused attribute (it declares it, None until here: `Attention.qkv_proj`,
    `MLP.gate_up_proj`) and its members are prepackable, over one input size, all with a bias or
    all without; returns how many linears were fused. Other groups stay separate linears."""
    fused = 0
    for parent in list(model.modules()):
        for group, members in FUSED_LINEARS.items():
            attr, names = group.rsplit(".", 1)[-1], [m.rsplit(".", 1)[-1] for m in members]
            if not hasattr(parent, attr) or getattr(parent, attr) is not None:
                continue
            linears = [lin for lin in (getattr(parent, name, None) for name in names) if _prepackable(lin)]
            if len(linears) < len(names) or len({(lin.in_features, lin.bias is None) for lin in linears}) != 1:
                continue
            whole = FusedPrepackedLinear(linears, few_rows, batch_invariant)
            setattr(parent, attr, whole)
            for i, name in enumerate(names):
                setattr(parent, name, PrepackedPart(whole, i))
            fused += len(names)
    return fused


class BlockedEmbedding(nn.Module):
    """The token embedding of a model whose LM head shares its table (tied embeddings), reading its
    rows from the LM head's few-row copy (`Bf16Gemv.block`'s [N/16, K/32, 16, 32] layout).

    A prepacked LM head holds the table in oneDNN's layout and in the few-row product's; the plain
    table beside them would be a third copy, kept only to look up a step's few rows. Rows come back
    bit for bit. `.weight` unblocks a copy, for code that reads the whole table (its dtype or device
    at start-up)."""

    def __init__(self, head: PrepackedLinear) -> None:
        super().__init__()
        if not self.lends_rows(head) or head.blocked is None:
            raise ValueError("the LM head keeps no few-row copy to look embedding rows up in")
        self.blocked = head.blocked  # the LM head's tensor, not a copy
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and int(ids.min()) < 0:  # floor division would wrap it onto a real row
            raise IndexError(f"token id {int(ids.min())} is out of the embedding's range")
        tile = self.blocked.shape[2]
        rows = self.blocked[ids // tile, :, ids % tile, :]  # [*ids.shape, K/32, 32]; past the end: IndexError
        return rows.reshape(*ids.shape, self.embedding_dim)

    @staticmethod
    def lends_rows(head: object) -> TypeGuard[PrepackedLinear]:
        """Whether `head` is a prepacked linear keeping the few-row product's blocked copy."""
        return isinstance(head, PrepackedLinear) and head.blocked is not None and isinstance(head.gemv, Bf16Gemv)

    @property
    def weight(self) -> torch.Tensor:
        return Bf16Gemv.unblock(self.blocked, self.num_embeddings).contiguous()

    @property
    def dtype(self) -> torch.dtype:
        return self.blocked.dtype

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows read from the tied LM head's blocked copy"


def _tied_embedding(model: nn.Module) -> nn.Embedding | None:
    """The model's token embedding where its LM head is a plain linear over the same table."""
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    if type(embedding) is nn.Embedding and _prepackable(head) and head.weight is embedding.weight:
        return embedding
    return None


def prepack_dense_linears(model: nn.Module, fuse: bool = False, batch_invariant: bool = False) -> int:
    """Swap every dense bf16 `nn.Linear` of a CPU model for a `PrepackedLinear` (the runtime
    module swap for serving); returns how many. Tied weights (an LM head sharing the embedding)
    get a packed copy; the embedding then reads its rows from the head's few-row copy where it
    has one (`BlockedEmbedding`), else keeps its plain tensor for lookups. With `fuse`, q/k/v and
    gate/up become one `FusedPrepackedLinear` each where their linears can share one product
    (`_fuse_groups`). Where the few-row C product is built and its copies fit in memory
    (`_few_row_copies`), each also keeps a blocked copy of its weight for decode-sized inputs.
    With `batch_invariant`, every linear runs one C product for any row count (and keeps only
    that product's copy)."""
    few_rows = not batch_invariant and _few_row_copies(model)
    fused = _fuse_groups(model, few_rows, batch_invariant) if fuse else 0
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if _prepackable(child)]
    tied = _tied_embedding(model)
    for parent, name, child in swaps:
        setattr(parent, name, PrepackedLinear(child, few_rows, batch_invariant))
    head = getattr(model, "lm_head", None)
    if tied is not None and tied.padding_idx is None and BlockedEmbedding.lends_rows(head):
        cast(Any, model).model.embed_tokens = BlockedEmbedding(head)
    return fused + len(swaps)
