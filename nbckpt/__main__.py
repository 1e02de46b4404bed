"""The nbckpt command line: thin faces over the Python API.

    nbckpt bench --dir data/checkpoints/bench --preset tiny --json out.json
    nbckpt probe /mnt/flashblade
    nbckpt report --name report
    nbckpt --version
    python -m nbckpt --help
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ._errors import NbckptError

__all__ = ["COMMANDS", "build_parser", "main"]

# subcommand -> module exposing add_arguments(parser) and main(args) -> int
COMMANDS = {
    "bench": ("nbckpt.experiment", "run sync and async checkpoint strategies side by side"),
    "probe": ("nbckpt.storage", "measure what a storage path or s3:// URL can do"),
    "report": ("nbckpt.report", "run the report notebook and render offline HTML"),
}


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="nbckpt",
        description="See and fix what checkpointing costs a PyTorch training run.",
        epilog="Run 'nbckpt COMMAND --help' for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"nbckpt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(command)
        command.set_defaults(module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, run the command; exit status 2 with one line for a user's mistake."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(importlib.import_module(args.module).main(args))
    except NbckptError as exc:
        print(f"nbckpt {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"nbckpt {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
