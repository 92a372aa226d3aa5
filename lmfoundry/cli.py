"""The `lmfoundry` command line.

Subcommands are imported lazily (`LazyGroup`) so that `lmfoundry --help` and light commands such
as `plan` or `inspect` start without importing torch. Each verb has one module under
`lmfoundry/commands/` that parses its options and calls into the stage that does the work; this
file only lists them.
"""

from __future__ import annotations

import importlib
import os
import sys

import click

from lmfoundry.errors import LmfoundryError, disk_full
from lmfoundry.runtime.cpu.isa import apply as apply_cpu_isa

# name -> "module:attribute". Keep in the order shown by --help.
COMMANDS: dict[str, str] = {
    "quantize": "lmfoundry.commands.quantize:quantize",
    "doctor": "lmfoundry.commands.doctor:doctor",
    "inspect": "lmfoundry.commands.inspect:inspect_cmd",
    "eval": "lmfoundry.commands.eval:eval_group",
    "eval-gate": "lmfoundry.commands.eval_gate:eval_gate",
    "export": "lmfoundry.commands.export:export_cmd",
    "compile": "lmfoundry.commands.compile:compile_cmd",
    "serve": "lmfoundry.commands.serve:serve",
    "bench": "lmfoundry.commands.bench:bench",
    "plan": "lmfoundry.commands.plan:plan",
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for name, target in COMMANDS.items() if _module_exists(target)]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None or not _module_exists(target):
            return None
        module_name, attr = target.split(":")
        return getattr(importlib.import_module(module_name), attr)


def _module_exists(target: str) -> bool:
    import importlib.util

    module_name = target.split(":")[0]
    try:
        return importlib.util.find_spec(module_name) is not None
    except ModuleNotFoundError:
        return False


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="lmfoundry")
def cli() -> None:
    """lmfoundry: quantize an open-weights LLM, compile its kernels, serve it, and gate it.

    \b
    Typical flow:
      lmfoundry quantize smollm2-135m --method rtn --scheme w4a16 --group-size 64 -o out/
      lmfoundry inspect out/
      lmfoundry eval ppl out/
      lmfoundry compile out/ --arch hopper
      lmfoundry serve out/
      lmfoundry eval-gate out/ --baseline smollm2-135m
    """


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI, turning an `LmfoundryError` into one line on stderr and a non-zero exit."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        apply_cpu_isa()  # LMFOUNDRY_CPU_ISA, before torch picks its kernels (a no-op when unset)
        cli.main(args=argv, standalone_mode=False)
    except LmfoundryError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.UsageError as exc:  # a mistyped option or value: one line, and where the help is
        command = exc.ctx.command_path if exc.ctx is not None else "lmfoundry"
        click.echo(f"error: {exc.format_message()} (see `{command} --help`)", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - only a full disk is turned into one line; the rest re-raised
        if not disk_full(exc):
            raise
        # a verb's writers stage their output and remove the staging folder on the way out
        where = getattr(exc, "filename", None) or "the output folder"
        click.echo(f"error: {where}: no space left on the device; nothing was written — "
                   "free space there or write elsewhere", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
