"""The ``nbckpt`` command line: thin faces over the Python API.

    nbckpt bench --dir data/checkpoints/bench --preset tiny --json out.json
    nbckpt probe /mnt/flashblade
    nbckpt report --name report
    python -m nbckpt --help
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ._errors import NbckptError

# subcommand -> module exposing add_arguments(parser) and main(args) -> int
COMMANDS = {
    "bench": ("nbckpt.experiment", "run sync and async checkpoint strategies side by side"),
    "probe": ("nbckpt.storage", "measure what a storage path or s3:// URL can do"),
    "report": ("nbckpt.report", "run the report notebook and render offline HTML"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nbckpt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(command)
        command.set_defaults(module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
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
