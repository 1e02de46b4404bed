"""Counts of run_lightning.sh's or run_transformers.sh's JUnit files, and the tests that pass as
they are (``default``: Lightning's default IO, the Trainer's own checkpoints) but not with nbckpt:
``python summarize.py OUT``."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def outcomes(files: list[Path]) -> dict[str, str]:
    """Each test case's outcome (passed, failed, error, skipped) by its node id."""
    out = {}
    for file in files:
        for case in ET.parse(file).iter("testcase"):
            name = f"{case.get('file') or case.get('classname')}::{case.get('name')}"
            kinds = [child.tag for child in case if child.tag in {"failure", "error", "skipped"}]
            out[name] = {"failure": "failed"}.get(kinds[0], kinds[0]) if kinds else "passed"
    return out


def main(out: Path) -> None:
    runs = {io: outcomes(sorted(out.glob(f"{io}-*.xml"))) for io in ("default", "nbckpt")}
    for io, found in runs.items():
        kinds = ("passed", "failed", "error", "skipped")
        counts = {kind: sum(v == kind for v in found.values()) for kind in kinds}
        print(io, ", ".join(f"{n} {kind}" for kind, n in counts.items()))
    passing = {name for name, kind in runs["default"].items() if kind == "passed"}
    if runs["nbckpt"]:
        kept = sum(runs["nbckpt"].get(name) == "passed" for name in passing)
        print(f"{kept} of the {len(passing)} passing as they are (default) pass with nbckpt; the others:")
        for name in sorted(passing):
            if runs["nbckpt"].get(name) != "passed":
                print(f"  {runs['nbckpt'].get(name, 'not run')}: {name}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
