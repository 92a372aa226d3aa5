"""`lmfoundry export`: a quantized checkpoint in another runtime's format (GGUF for llama.cpp)."""

from __future__ import annotations

from pathlib import Path

import click

from lmfoundry.errors import UserError


@click.command("export")
@click.argument("checkpoint")
@click.option("--format", "fmt", type=click.Choice(["gguf"]), default="gguf", show_default=True,
              help="Target format.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Output file (model.gguf).")
@click.option("--tokenizer-pre", default=None,
              help="llama.cpp's pre-tokenizer name for the vocabulary (e.g. smollm, llama-bpe, qwen2); "
                   "llama.cpp splits text with it. Default: identified as llama.cpp's converter does (a "
                   "tokenizer it cannot identify is refused); a name contradicting that is refused.")
@click.option("--embedding-type", type=click.Choice(["auto", "f32", "f16", "bf16", "q8_0"]), default="auto",
              show_default=True,
              help="How the token embedding is stored: auto keeps the checkpoint's dtype (a float32 embedding is "
                   "large: 4 bytes a value); f16 halves it; q8_0 (ggml's 8-bit blocks of 32 with an fp16 scale) "
                   "is about a quarter. With tied embeddings llama.cpp also uses it as the LM head.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output file.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def export_cmd(checkpoint: str, fmt: str, output: str, tokenizer_pre: str | None, embedding_type: str,
               overwrite: bool, quiet: bool) -> None:
    """Write CHECKPOINT (the output of `lmfoundry quantize`) as one GGUF file, mapping our integer
    codes onto ggml blocks without requantizing: int4 symmetric -> Q4_0, int4 asymmetric -> Q4_1,
    int8 symmetric -> Q8_0 (group sizes that are multiples of 32, or per channel). Quantize with
    `--dtype float16` for fp16 scales, which Q4_0/Q8_0 then carry bit-exactly."""
    from lmfoundry.export.gguf import export_gguf
    from lmfoundry.manifest import sha256_file
    from lmfoundry.output_paths import refuse_overlap

    out = Path(output).expanduser()
    refuse_overlap(out, [checkpoint])  # before --overwrite is considered: an input is never replaced
    if out.exists() and not overwrite:
        raise UserError(f"{out} exists (pass --overwrite to replace it)")
    if out.exists() and not out.is_file():
        raise UserError(f"{out} exists and is not a file")
    report = export_gguf(checkpoint, out, tokenizer_pre=tokenizer_pre, progress=not quiet,
                         embedding_type=embedding_type)
    types = ", ".join(f"{n} {k}" for k, n in sorted(report.types.items()))
    click.echo(f"wrote {report.path} ({fmt}, {report.bytes / 2**20:.1f} MiB, {report.tensors} tensors: {types})")
    click.echo(f"pre-tokenizer {report.tokenizer_pre} (llama.cpp's tokenizer.ggml.pre)")
    click.echo(f"largest scale change from rounding to fp16: {report.max_scale_rounding:.2e} (0 = bit-exact)")
    click.echo(f"sha256 {sha256_file(report.path)}")
