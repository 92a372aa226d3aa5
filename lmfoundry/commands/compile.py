"""`lmfoundry compile CHECKPOINT --arch hopper [--arch ampere ...] [-o ENGINE]`, or `--arch cpu`.

Parses the flags and prints the bundle; the build is `lmfoundry.compile(...)` (lmfoundry/api/artifact_builds.py),
so the command and a script compile through one path.
"""

from __future__ import annotations

from collections import Counter

import click


@click.command("compile")
@click.argument("checkpoint", type=click.Path(path_type=str))
@click.option("--arch", "archs", multiple=True, required=True,
              help="Target: ampere (sm_80), ada (sm_89) or hopper (sm_90a), repeatable; or cpu alone: the "
                   "engine's CPU step compiled ahead of time with AOTInductor for this machine's ISA "
                   "(amx/avx512/avx2), served by `lmfoundry serve ENGINE --device cpu` without JIT.")
@click.option("-o", "--output", type=click.Path(path_type=str), default=None,
              help="Engine folder to write (default: CHECKPOINT-engine next to the checkpoint).")
@click.option("--weights", type=click.Choice(["link", "copy", "repack"]), default="repack", show_default=True,
              help="Write the weights with the GEMM fusions applied (what the runtime reads; the bundle is "
                   "self-contained), copy the checkpoint's files, or symlink them (not deployable).")
@click.option("--jobs", "workers", type=int, default=2, show_default=True, help="Compile worker processes.")
@click.option("--block-size", type=int, default=16, show_default=True, help="Paged KV cache block size (tokens).")
@click.option("--dtype", type=click.Choice(["auto", "float16", "bfloat16"]), default="auto", show_default=True,
              help="Activation dtype of the kernels (auto: the checkpoint's, bfloat16 for float32 ones).")
@click.option("--tune", is_flag=True, help="Time the tile candidates on the local GPU for its own arch.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="--arch cpu: the most tokens one compiled step takes (decodes plus prefill chunk; default "
                   "8192; a larger step runs eagerly).")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tensor-parallel degree: write one bundle per rank (rank<r>/), each with that rank's share of "
                   "the weights and the kernels for its shapes; serve it with the same --tp.")
@click.option("--max-loras", type=click.IntRange(min=1), default=None,
              help="Build the LoRA kernels (the gathered shrink/expand pair of every adapted product) so that "
                   "`serve ENGINE --lora ...` runs up to this many adapters at once on the GPU.")
@click.option("--max-lora-rank", type=click.IntRange(min=1), default=16, show_default=True,
              help="With --max-loras: the largest adapter rank the kernels take.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def compile_cmd(checkpoint: str, archs: tuple[str, ...], output: str | None, weights: str, workers: int,
                block_size: int, dtype: str, tune: bool, max_tokens: int | None, tp: int, quiet: bool,
                max_loras: int | None = None, max_lora_rank: int = 16) -> None:
    """Cross-compile the Triton kernels CHECKPOINT needs into an engine bundle (no GPU needed).

    \b
    Examples:
      lmfoundry compile out/ --arch hopper --arch ampere -o engine/
      lmfoundry compile out/ --arch cpu -o engine-cpu/
      lmfoundry compile out/ --arch hopper --tp 2 -o engine-tp2/
    """
    from lmfoundry.api.artifact_builds import compile as compile_bundle

    bundle = compile_bundle(checkpoint, arch=archs, output=output, weights=weights, jobs=workers,
                            block_size=block_size, dtype=dtype, tune=tune, max_tokens=max_tokens, tp=tp,
                            max_loras=max_loras, max_lora_rank=max_lora_rank, quiet=quiet)
    click.echo(f"engine: {bundle.path}" + (f" ({tp} ranks: rank0/ .. rank{tp - 1}/)" if tp > 1 else ""))
    if bundle.scheme["target"] == "cpu":
        cpu = bundle.manifest["cpu"]
        click.echo(f"cpu step: {cpu['step']['path']} ({cpu['step']['bytes'] / 2**20:.1f} MiB, {cpu['isa']}, "
                   f"1..{cpu['max_tokens']} tokens a step), built in {bundle.seconds:.1f} s")
        return
    per_arch = Counter(k["sm"] for k in bundle.kernels)
    click.echo(f"kernels: {len(bundle.kernels)} ({', '.join(f'{sm}: {n}' for sm, n in sorted(per_arch.items()))}), "
               f"SASS checks passed, built in {bundle.seconds:.1f} s")
    click.echo(f"fusions: {', '.join(bundle.fusions) or 'none'}")
    if max_loras is not None:
        click.echo(f"lora: kernels for {max_loras} adapter(s) up to rank {max_lora_rank}")
