"""Engine knobs: KV block size and count, batch limits, queue bound, KV storage dtype, speculative
decoding, batch-invariant (deterministic) execution, LoRA adapters."""

from __future__ import annotations

from dataclasses import dataclass

from lmfoundry.errors import UserError

# Default step budgets (`serve --max-num-batched-tokens`, and what eval runs the serving engine
# with). Every running stream waits for the whole step, and on CPU a step's time grows with its
# rows long after the matrix units are busy, so past that point a larger chunk only lengthens the
# wait (benchmarks/results/serve_peers_avx2.md measures 1024 against 2048); 2048 is vLLM's default,
# for GPUs, whose units need many more rows to be busy.
CPU_STEP_TOKENS = 1024
GPU_STEP_TOKENS = 2048


def default_step_tokens(device: str) -> int:
    """--max-num-batched-tokens when not given: smaller on CPU (see CPU_STEP_TOKENS)."""
    return CPU_STEP_TOKENS if str(device).startswith("cpu") else GPU_STEP_TOKENS


def check_lora_slots_fit(max_loras: int, max_rank: int, slot_bytes: int, free: int, where: str) -> None:
    """Refuse, in one line naming the limit, `max_loras` adapter slots of `slot_bytes` each
    (stacked, allocated at start) past `free` bytes of memory (`where`: whose). The allocator's
    own refusal was a traceback (--max-loras 100000000 asked for 2.4 TB), and on a CPU an
    allocation that only just succeeds is the out-of-memory killer's later. `serve` checks before
    the model loads, with 16-bit slots against the machine's available memory
    (`lora_options.check_lora_memory`); the engine again with its dtype and device, before it
    allocates them (`lora_adapters.LoRAStack`)."""
    if max_loras * slot_bytes > free:
        raise UserError(f"--max-loras {max_loras}: {max_loras} adapter slots of rank {max_rank} need "
                        f"{max_loras * slot_bytes / 2**30:,.1f} GiB ({slot_bytes / 2**20:,.2f} MiB a slot), more than "
                        f"the {free / 2**30:,.1f} GiB {where}; at most {free // slot_bytes} fit, with nothing left "
                        "for the model and its KV cache")


@dataclass
class EngineConfig:
    block_size: int = 16
    # KV capacity: an explicit block count, else as many blocks as fit in kv_cache_memory_gb.
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    # Longest prompt + output; None: the model's max_position_embeddings capped by the KV capacity.
    max_model_len: int | None = None
    max_num_seqs: int = 64  # sequences decoded together
    # Tokens per forward pass. Decodes take one each; prefills are chunked into what is left, so a
    # long prompt never stalls running decodes for more than one chunk's worth of compute.
    max_num_batched_tokens: int = 256
    # Sequences allowed to wait for a slot beyond max_num_seqs; more are refused (HTTP 429).
    max_waiting_requests: int = 256
    enable_prefix_caching: bool = True
    # Decode attention over a prefix shared by the whole batch reads it once (cascade attention).
    cascade_attention: bool = True
    # "auto" (the checkpoint's kv_cache_scheme if any, else the model dtype), "float32",
    # "bfloat16", "float16", "int8", "fp8" (the last two need k/v scales from the checkpoint).
    kv_cache_dtype: str = "auto"
    num_threads: int | None = None  # torch intra-op threads; None keeps the process setting
    # Tensor parallelism (tensor_parallel.py): ranks the model is split over, each a process with
    # num_threads / tensor_parallel_size threads, joined by "shm" (shared memory) or "gloo".
    tensor_parallel_size: int = 1
    tp_backend: str = "shm"
    # Decode steps of an engine bundle on a GPU replay a CUDA graph per batch-size bucket (no
    # per-kernel launch or argument packing cost); False runs every step eagerly.
    cuda_graphs: bool = True
    # Speculative decoding (see speculative.py): None (off), "ngram" (prompt lookup: the tokens that
    # followed the last n-gram's earlier occurrence) or "draft" (a smaller model's greedy tokens;
    # LLMEngine then needs a draft_model). Each decoding sequence gets up to
    # num_speculative_tokens draft tokens, which the target scores in one forward and accepts while
    # they match what it samples itself, so outputs are those of plain decoding.
    speculative: str | None = None
    num_speculative_tokens: int = 4
    ngram_max: int = 3  # longest n-gram looked up (prompt lookup); shorter ones are tried next
    ngram_min: int = 1
    # Batch-invariant execution (batch_invariant.py): a request's tokens and logprobs are bit for bit
    # the same whatever else is in its batch and whether its prefix came from the cache; slower.
    deterministic: bool = False
    # LoRA adapters (lora.py): slots of the stacked adapter weights (0: LoRA off), the largest rank
    # they hold, and the adapters loaded at start as (name, PEFT folder) pairs.
    max_loras: int = 0
    max_lora_rank: int = 16
    lora_modules: tuple[tuple[str, str], ...] = ()

    @property
    def rank_threads(self) -> int | None:
        """Intra-op threads of each tensor-parallel rank (None: the process setting)."""
        if self.num_threads is None:
            return None
        return max(1, self.num_threads // self.tensor_parallel_size)

    def check_speculative(self) -> None:
        """Refuse speculative settings that cannot work, in one line (the CLI turns it into an error)."""
        if self.speculative not in (None, "ngram", "draft"):
            raise ValueError(f"speculative must be None, 'ngram' or 'draft', got {self.speculative!r}")
        if self.speculative is not None and self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}..{self.ngram_max}")
