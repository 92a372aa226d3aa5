"""Turn a GGUF file into a Hugging Face safetensors folder one tensor at a time.

`AutoModelForCausalLM.from_pretrained(gguf_file=...)` dequantizes every tensor into one float model
before anything can be saved, so converting needs the whole model in float32 in memory, several
times the GGUF's size. Here each tensor is read from the file, dequantized, put through
the same per-tensor transforms transformers applies (its `TENSOR_PROCESSORS`: llama.cpp's q/k row
permutation for Llama, the `w + 1` norms of Gemma), cast, and added to a shard of bounded size that
is written as soon as it is full. Peak memory is about one float32 tensor plus one shard.

The names, the values and the config are transformers' own: the skeleton model (on the meta
device, no memory) gives the name map through `get_gguf_hf_weights_map`, and the config and
tokenizer come from `AutoConfig` / `AutoTokenizer` with `gguf_file=`. Tensors are read with plain
file reads rather than through the reader's memory map, so the pages of the GGUF file do not count
as this process's memory once read.
"""

from __future__ import annotations

import io
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from lmfoundry.errors import UserError
from lmfoundry.model.config import ModelConfig

# Bump when the conversion's output changes (names, values, layout): cached folders made by an
# older converter are then converted again instead of reused (see sources._converted_gguf).
CONVERTER_VERSION = 1
SHARD_BYTES = 1 << 30
# Quantized tensors are dequantized this many float32 values at a time, so numpy's per-block
# temporaries stay small next to the tensor itself.
DEQUANT_CHUNK_VALUES = 1 << 22
INDEX_NAME = "model.safetensors.index.json"


def conversion_label(dtype_name: str) -> str:
    """What a converted folder records about how it was made: changing either part means the
    cached folder no longer matches and is rebuilt."""
    return f"gguf-import/{CONVERTER_VERSION} {dtype_name}"


def import_gguf(gguf: Path, out: Path, dtype_name: str, shard_bytes: int = SHARD_BYTES) -> dict[str, Any]:
    """Write `gguf`'s weights (as `dtype_name`: "float32" or "bfloat16"), tokenizer and generation
    config into the folder `out`, and return the config dict for `out/config.json`; the caller
    writes that file last, since its presence marks a complete folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    try:
        from gguf import GGUFReader
        from transformers.integrations.gguf import is_gguf_arch_supported
        from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map, load_gguf_checkpoint

        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        gguf_config = load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]
        reader = GGUFReader(gguf)
    except Exception as exc:  # transformers and gguf raise many types for an unreadable GGUF
        raise UserError(f"{gguf}: could not load GGUF ({type(exc).__name__}: {exc})") from None
    ModelConfig.from_dict(config.to_dict())  # an unsupported architecture is refused before any work
    arch = str(reader.fields["general.architecture"].contents())
    if is_gguf_arch_supported(arch):  # transformers' packed-weight path, with other transforms
        raise UserError(f"{gguf}: GGUF architecture {arch!r} is not supported by the streaming converter")
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    processor = _processor(arch, gguf_config)
    names = get_gguf_hf_weights_map(skeleton, processor)
    wanted = set(skeleton.state_dict())
    if config.tie_word_embeddings:
        wanted.discard("lm_head.weight")

    shards = _ShardWriter(out, shard_bytes)
    print(f"  {len(reader.tensors)} tensors -> {dtype_name} shards of at most {shard_bytes >> 20} MiB",
          file=sys.stderr)

    def store(ready: list[tuple[str, Any]]) -> None:
        while ready:  # popped, so that each float32 tensor is freed as soon as it is cast
            name, tensor = ready.pop(0)
            if name in wanted:
                shards.make_room(tensor.numel() * dtype.itemsize)  # before the cast copy exists
                shards.add(name, tensor.to(dtype).contiguous())
            del tensor

    with open(gguf, "rb") as f:
        stream = _TensorStream(f, reader.tensors, names, processor)
        for t in reader.tensors:
            store(stream.take(t))
        store(stream.rest())
    missing = sorted(wanted - shards.written)
    if missing:
        raise UserError(f"{gguf}: the GGUF has no tensor for {len(missing)} weights of the "
                        f"{config.model_type} model (first: {missing[0]})")
    shards.finish()

    cfg = config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    cfg["architectures"] = [type(skeleton).__name__]
    cfg["dtype"] = cfg["torch_dtype"] = dtype_name
    if getattr(skeleton, "generation_config", None) is not None:
        skeleton.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return cfg


def _processor(arch: str, gguf_config: dict[str, Any]) -> Any:
    """The per-tensor transform transformers' legacy GGUF loader applies for `arch`."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=gguf_config)


class _TensorStream:
    """The file's tensors as transformers' legacy GGUF loader computes them (dequantize,
    `processor.process`, rename to the parameter name), one GGUF tensor at a time.

    Some processors (the MoE ones) do not return a tensor but assemble it in
    `parsed_parameters["tensors"]` from several GGUF tensors; such a tensor is handed out once the
    last GGUF tensor that maps to it has been read."""

    def __init__(self, f: io.BufferedReader, tensors: list[Any], names: dict[str, str], processor: Any) -> None:
        self.f, self.names, self.processor = f, names, processor
        self.assembled: dict[str, Any] = {"tensors": {}}
        self.pending = Counter(self._target(t.name) for t in tensors)

    def _target(self, gguf_name: str) -> str | None:
        return self.names.get(gguf_name) or self.names.get(gguf_name.rsplit(".", 1)[0])

    def take(self, t: Any) -> list[tuple[str, Any]]:
        """`[(parameter name, float32 tensor)]` that reading GGUF tensor `t` completes."""
        import numpy as np
        import torch

        weights = _dequantized(_read(self.f, t), t.tensor_type)
        result = self.processor.process(weights=weights, name=t.name, tensor_key_mapping=self.names,
                                        parsed_parameters=self.assembled)
        del weights
        self.pending[self._target(t.name)] -= 1
        ready = []
        if result.name is not None and result.name in self.names:
            ready.append((self.names[result.name], torch.from_numpy(np.ascontiguousarray(result.weights))))
        del result
        assembled = self.assembled["tensors"]
        ready += [(k, assembled.pop(k)) for k in list(assembled) if self.pending.get(k, 0) <= 0]
        return ready

    def rest(self) -> list[tuple[str, Any]]:
        """Whatever is still being assembled once the whole file has been read."""
        ready = list(self.assembled["tensors"].items())
        self.assembled["tensors"].clear()
        return ready


def _read(f: io.BufferedReader, t: Any) -> Any:
    """Tensor `t`'s stored bytes, laid out like the reader's view of them (`t.data`), in memory
    this process owns."""
    import numpy as np

    buf = np.empty(t.n_bytes, np.uint8)
    f.seek(t.data_offset)
    if f.readinto(memoryview(buf.data)) != t.n_bytes:
        raise UserError(f"{f.name}: truncated GGUF file (tensor {t.name} ends past the end)")
    return buf.view(t.data.dtype).reshape(t.data.shape)


def _dequantized(raw: Any, qtype: Any) -> Any:
    """`gguf.quants.dequantize(raw, qtype)`, a slice of rows at a time for block-quantized data
    (blocks never span rows, so the values are the same)."""
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize

    if raw.dtype != np.uint8 or qtype == GGMLQuantizationType.BF16 or raw.ndim < 2:
        return dequantize(raw, qtype)
    rows = raw.reshape(-1, raw.shape[-1])
    first = dequantize(rows[:1], qtype)
    out = np.empty((rows.shape[0], first.shape[-1]), first.dtype)
    step = max(1, DEQUANT_CHUNK_VALUES // first.shape[-1])
    for start in range(0, rows.shape[0], step):
        out[start:start + step] = dequantize(rows[start:start + step], qtype)
    return out.reshape(*raw.shape[:-1], first.shape[-1])


class _ShardWriter:
    """Collects tensors and writes a safetensors shard whenever the next tensor would take it past
    `limit` bytes (a larger tensor gets a shard of its own). `finish` names the shards the way
    `save_pretrained` does: one `model.safetensors`, or numbered shards plus an index."""

    def __init__(self, folder: Path, limit: int) -> None:
        self.folder, self.limit = folder, limit
        self.buffer: dict[str, Any] = {}
        self.buffered = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.written: set[str] = set()
        self.total = 0

    def make_room(self, nbytes: int) -> None:
        """Write the shard now if a tensor of `nbytes` will not fit in it."""
        if self.buffer and self.buffered + nbytes > self.limit:
            self._flush()

    def add(self, name: str, tensor: Any) -> None:
        if name in self.written:
            raise UserError(f"two GGUF tensors convert to {name}")
        nbytes = tensor.numel() * tensor.element_size()
        self.make_room(nbytes)
        self.buffer[name] = tensor
        self.buffered += nbytes
        self.written.add(name)
        self.total += nbytes

    def _flush(self) -> None:
        import safetensors.torch

        path = self.folder / f".shard-{len(self.files):05d}.safetensors"
        safetensors.torch.save_file(self.buffer, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.buffer)))
        print(f"  shard {len(self.files)}: {len(self.buffer)} tensors, {self.buffered >> 20} MiB "
              f"({len(self.written)} converted)", file=sys.stderr)
        self.buffer, self.buffered = {}, 0

    def finish(self) -> None:
        if self.buffer:
            self._flush()
        if len(self.files) == 1:
            os.replace(self.files[0][0], self.folder / "model.safetensors")
            return
        weight_map = {}
        for i, (path, names) in enumerate(self.files, 1):
            final = f"model-{i:05d}-of-{len(self.files):05d}.safetensors"
            os.replace(path, self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
