"""`lmfoundry compile CHECKPOINT --arch hopper [--arch ampere ...] [-o ENGINE]`, or `--arch cpu`."""

from __future__ import annotations

from collections import Counter

import click

from lmfoundry.errors import UserError


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
    log = (lambda m: None) if quiet else (lambda m: click.echo(m, err=True))
    if any(a.strip().lower() == "cpu" for a in archs):
        if len(archs) > 1:
            raise UserError("--arch cpu builds a bundle of its own (a compiled CPU step, no cubins): "
                            "run it separately from the GPU archs")
        if tp > 1:
            raise UserError(f"--arch cpu compiles one process's step; --tp {tp} serves the checkpoint (or a GPU "
                            "arch's bundle) split over CPU processes without a compiled step")
        if max_loras is not None:
            raise UserError("--max-loras builds GPU kernels; an --arch cpu bundle serves adapters without them "
                            "(`serve ENGINE --lora ...` runs steps with adapter rows on its eager layers)")
        from lmfoundry.compile.cpu_step import DEFAULT_MAX_TOKENS, build_cpu_engine

        step_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
        out, manifest, seconds = build_cpu_engine(checkpoint, output, block_size=block_size,
                                                  max_tokens=step_tokens, log_line=log)
        cpu = manifest["cpu"]
        click.echo(f"engine: {out}")
        click.echo(f"cpu step: {cpu['step']['path']} ({cpu['step']['bytes'] / 2**20:.1f} MiB, {cpu['isa']}, "
                   f"1..{cpu['max_tokens']} tokens a step), built in {seconds:.1f} s")
        return
    if max_tokens is not None:
        raise UserError("--max-tokens applies to --arch cpu only")
    from lmfoundry.compile.bundle import build_engine

    result = build_engine(checkpoint, list(archs), output, weights=weights, workers=workers, block_size=block_size,
                          dtype=None if dtype == "auto" else dtype, tune=tune, progress=not quiet,
                          log=log, tp=tp, lora=(max_loras, max_lora_rank) if max_loras is not None else None)
    kernels = result.kernels
    per_arch = Counter(k["sm"] for k in kernels)
    fusions = [f["name"] for f in result.fusions if f["applied"]]
    click.echo(f"engine: {result.output}" + (f" ({tp} ranks: rank0/ .. rank{tp - 1}/)" if tp > 1 else ""))
    click.echo(f"kernels: {len(kernels)} ({', '.join(f'{sm}: {n}' for sm, n in sorted(per_arch.items()))}), "
               f"SASS checks passed, built in {result.seconds:.1f} s")
    click.echo(f"fusions: {', '.join(fusions) or 'none'}")
    if max_loras is not None:
        click.echo(f"lora: kernels for {max_loras} adapter(s) up to rank {max_lora_rank}")
