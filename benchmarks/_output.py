"""What the framework benchmarks share: where the numbers were measured, and the JSON they write."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbckpt.bench import environment

__all__ = ["finish", "parser"]


def parser(doc: str, *, repeats: int, directory: str, quick: str) -> argparse.ArgumentParser:
    """The options every framework benchmark takes; each adds its own."""
    parsed = argparse.ArgumentParser(description=doc.splitlines()[0])
    parsed.add_argument("--repeats", type=int, default=repeats)
    parsed.add_argument("--dir", default=directory, help="where the checkpoints are written")
    parsed.add_argument("--quick", action="store_true", help=quick)
    parsed.add_argument("--json", help="write the results here")
    return parsed


def finish(run: Callable[[argparse.Namespace], dict[str, Any]], args: argparse.Namespace) -> None:
    """Run the benchmark, add the machine it ran on, and write the result to ``args.json`` if given."""
    result = {**run(args), "environment": environment(getattr(args, "device", "cpu"))}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
