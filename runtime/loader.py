"""Load what `serve`, `eval` and the API run: a model folder, GGUF file, built-in name or
quantized checkpoint (through `checkpoint_model.load_causal_lm`), or an engine bundle: an
`--arch cpu` bundle's compiled step (`runtime.cpu.bundle_loading`), a GPU bundle's `KernelModel`
(`runtime.kernel_model`) or, on a CPU, its weights in the reference model; one tensor-parallel
rank's share of either. Also the execution dtype of `--dtype auto`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lmfoundry.checkpoint.folder import CheckpointReader
from lmfoundry.checkpoint.sources import resolve_model
from lmfoundry.checkpoint.tokenizer import has_tokenizer, load_tokenizer
from lmfoundry.engine_bundle.engine_manifest import (
    bundle_degree,
    is_engine_bundle,
    own_weights,
    rank_bundle,
    weights_folder,
)
from lmfoundry.errors import UserError
from lmfoundry.model.config import ModelConfig
from lmfoundry.model.tensor_parallel import Collectives, RankShard, shard_modules, share_of
from lmfoundry.runtime.checkpoint_model import load_causal_lm
from lmfoundry.runtime.placement import degree_refusal


def load_model(
    path_or_name: str | Path, dtype: torch.dtype | None = None, allow_pickle: bool = False,
    device: str | torch.device = "cpu", shard: RankShard | None = None, comm: Collectives | None = None,
) -> tuple[Any, Any]:
    """(model, tokenizer) for a model folder, GGUF file, built-in name or quantized checkpoint —
    the reference `CausalLM` on CPU, quantized weights packed in bfloat16 — or for an engine
    bundle: its `KernelModel` on a GPU; on the CPU its weights in the packed reference model
    (with the compiled step of an `--arch cpu` bundle), never the per-kernel references. With
    `shard`, one tensor-parallel rank's share of a checkpoint (see `load_causal_lm`), or of a
    bundle compiled with that `--tp` (`load_rank_bundle`)."""
    if is_engine_bundle(path_or_name):
        degree = bundle_degree(path_or_name)
        if degree != (shard.tp if shard is not None else 1):
            raise UserError(degree_refusal(path_or_name, degree, shard.tp if shard is not None else 1))
        if shard is not None:
            assert comm is not None, "a shard needs its rank's collectives"
            return load_rank_bundle(path_or_name, shard, comm, dtype, device)
        if torch.device(device).type == "cpu":
            return load_bundle_on_cpu(path_or_name, dtype)
        return load_bundle(path_or_name, device, dtype=dtype)
    if torch.device(device).type != "cpu":
        raise UserError(f"{path_or_name}: --device {device} runs an engine bundle's kernels; build one with "
                        f"`lmfoundry compile {path_or_name} --arch ...` and pass the bundle folder")
    folder = resolve_model(path_or_name, allow_pickle=allow_pickle)
    model = load_causal_lm(CheckpointReader(folder), dtype, shard, comm)
    return model, load_tokenizer(folder)


def whole_model_config(path: str | Path) -> ModelConfig:
    """The config of the whole model behind a model spec: a checkpoint's own, a bundle's
    weights', and for a tensor-parallel bundle the one its rank 0's share names."""
    if is_engine_bundle(path):
        weights = weights_folder(path)
        config = ModelConfig.from_file(weights)
        shard = share_of(config.raw, str(weights))
        return shard.config if shard is not None else config
    return ModelConfig.from_file(resolve_model(path))


def load_rank_bundle(path: str | Path, shard: RankShard, comm: Collectives, dtype: torch.dtype | None = None,
                     device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """(model, tokenizer) of rank `shard.rank` from a bundle compiled with `--tp`: that rank's
    share (`lmfoundry.compile.rank_shares`) loaded as the model its config describes (on a
    CPU the packed reference model, on a GPU its `KernelModel`), then joined to the other ranks,
    without slicing anything again."""
    folder = rank_bundle(path, shard.rank)
    share = share_of(ModelConfig.from_file(own_weights(folder)).raw, str(own_weights(folder)))
    if share is None or (share.rank, share.tp) != (shard.rank, shard.tp) or share.config != shard.config:
        raise UserError(f"{folder}: its weights are not rank {shard.rank} of {shard.tp}'s share of this model")
    if torch.device(device).type == "cpu":
        model, tokenizer = load_bundle_on_cpu(folder, dtype)
        shard_modules(model, share, comm, presliced=True)
    else:
        model, tokenizer = load_bundle(folder, device, dtype=dtype)
        model.join(share, comm)
    return model, tokenizer


def resolve_dtype(name: str, path_or_name: str | Path, device: str = "cpu") -> torch.dtype | None:
    """The execution dtype of a --dtype value: `auto` is this CPU's default (bfloat16 where it has
    bf16 arithmetic, see `cpu_isa`) for a model run on CPU, and None (the stored dtype) for an
    engine bundle on a GPU, whose kernels were compiled for its own dtype."""
    if name != "auto":
        return getattr(torch, name)
    if torch.device(device).type != "cpu":
        return None
    from lmfoundry.runtime.cpu.features import default_dtype

    return default_dtype()


def load_bundle_on_cpu(path: str | Path, dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) of an engine bundle served on a CPU: an `--arch cpu` bundle's compiled
    step; a GPU bundle's verified weights (un-tiled and un-fused again when compile repacked them:
    exact) in the reference model with packed linears, which is what a CPU runs fastest (its
    kernels' PyTorch references are a correctness tool)."""
    from lmfoundry.engine_bundle.engine_manifest import read_manifest, verify, verify_weights

    engine = Path(path)
    manifest = read_manifest(engine)
    if manifest.get("target") == "cpu":
        return load_bundle(engine, "cpu", dtype=dtype)
    # the kernels do not run here, but a bundle with a modified file is refused wherever it is read:
    # serving its weights would vouch for an artifact that is no longer the one compiled
    verify(engine, manifest)
    verify_weights(engine, manifest)
    weights = own_weights(engine)
    reader = CheckpointReader(weights)
    record = manifest["weights"]
    if record.get("mode") == "repack":
        from lmfoundry.checkpoint.folder import InMemoryCheckpoint
        from lmfoundry.engine_bundle.weight_layout import unrepack_bundle

        shapes = ModelConfig.from_dict(reader.config).linear_shapes
        fused = record.get("fused_tensors") or {}
        tensors = unrepack_bundle(reader.get(list(reader.index)), fused,
                                  lambda member: shapes[member.split(".", 3)[3]][0])
        reader = InMemoryCheckpoint(weights, reader.config, tensors)
    model = load_causal_lm(reader, dtype or reader.dtype)
    return model, load_tokenizer(weights) if has_tokenizer(weights) else None


def load_bundle(path: str | Path, device: str | torch.device = "cpu", interpret: bool | None = None,
                dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """(KernelModel, tokenizer) of an engine bundle: kernel files and weights verified against
    engine.json first (a tampered or foreign file refuses the bundle), then the kernels for
    `device` (cubins, JIT, interpreter or references) and the weights in their stored form."""
    from lmfoundry.engine_bundle.engine_manifest import read_manifest, verify_weights

    device = torch.device(device)
    engine = Path(path)
    manifest = read_manifest(engine)
    if manifest.get("target") == "cpu":
        if device.type != "cpu":
            raise UserError(f"{engine}: an --arch cpu bundle runs on --device cpu (compile the checkpoint for a "
                            "GPU arch to serve it on cuda)")
        from lmfoundry.runtime.cpu.bundle_loading import load_cpu_bundle

        return load_cpu_bundle(engine, manifest, dtype), load_tokenizer(own_weights(engine))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    verify_weights(engine, manifest)
    refusal = ModelConfig.from_file(own_weights(engine)).kernel_path_refusal()
    if refusal is not None:  # before any kernel is loaded (Gemma: see ModelConfig.kernel_path_refusal)
        raise UserError(f"{engine}: {refusal}")
    from lmfoundry.runtime.kernel_model import load_kernel_model  # here: an --arch cpu bundle never
    from lmfoundry.runtime.kernel_set import load_engine  # loads the GPU kernels' modules (Triton)

    kernels = load_engine(engine, device, interpret=interpret)
    model = load_kernel_model(engine, kernels, device)
    weights = own_weights(engine)
    return model, load_tokenizer(weights) if has_tokenizer(weights) else None
