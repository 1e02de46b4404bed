"""Format fuzzer, the long run (issue 34): thousands of damaged steps read by nbckpt, counted by outcome.

    .venv/bin/python benchmarks/fuzz_format.py --json data/results/fuzz-format-cpu.json
    .venv/bin/python benchmarks/fuzz_format.py --quick                    # 2 cases a family
    .venv/bin/python benchmarks/fuzz_format.py --seed 3401 --only dcp-metadata-deep/17   # one case again

The cases are ``tests/helpers/fuzz_edits.py``'s, run by ``tests/helpers/fuzz.py`` as the suite's
short mode runs them (``tests/reliability/test_fuzz_format.py``), with another seed and more of
them: for every family (native nbckpt steps and plain-DCP ``step-N/`` folders; the manifest,
``.metadata`` or a ``.distcp`` file; byte flips, truncations, field edits, duplicated keys, extreme
numbers, deep nesting; native edits re-signed three times in four), each case in a child process
under a memory limit and a time limit, read by ``restore()``, ``load()`` and ``verify()``. The
table counts outcomes per family; every failure is listed with its case id, which with the seed
reproduces it (``--only``). ``--budget-s`` stops starting new cases after that long, so that a
busy machine bounds the run rather than the number of cases.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from helpers.fuzz import FAILURES, Result, case_ids, make_runs, run_cases, table  # noqa: E402


def arguments() -> argparse.Namespace:
    parsed = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parsed.add_argument("--seed", type=int, default=3401)
    parsed.add_argument("--cases", type=int, default=150, help="cases per family")
    parsed.add_argument("--only", nargs="*", help="these case ids only (family/n)")
    parsed.add_argument("--timeout-s", type=float, default=30.0, help="a case longer than this is a hang")
    parsed.add_argument("--memory-mb", type=int, default=2048, help="address space a child may add")
    parsed.add_argument("--budget-s", type=float, default=600.0, help="start no case after this long")
    parsed.add_argument("--quick", action="store_true", help="2 cases a family: checks the script")
    parsed.add_argument("--json", help="write the counts and failures here")
    return parsed.parse_args()


def print_table(results: list[Result]) -> None:
    header, rows = table(results)
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)))


def run(args: argparse.Namespace) -> dict[str, Any]:
    cases = args.only or case_ids(2 if args.quick else args.cases)
    began = time.monotonic()
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="nbckpt-fuzz-") as scratch:
        runs = make_runs(Path(scratch))
        # Slices of cases in family order (every family in each), so that a budget that runs out
        # leaves every family counted.
        for start in range(0, len(cases), 220):
            if time.monotonic() - began > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: {len(cases) - start} cases not run")
                break
            results += run_cases(
                runs,
                args.seed,
                cases[start : start + 220],
                timeout_s=args.timeout_s,
                memory_mb=args.memory_mb,
            )
            failed = sum(r.outcome in FAILURES for r in results)
            print(f"{len(results)} cases, {failed} failures, {time.monotonic() - began:.0f} s", flush=True)
    wall = time.monotonic() - began
    print_table(results)
    failures = [r for r in results if r.outcome in FAILURES]
    print(f"\n{len(results)} cases in {wall:.0f} s (seed {args.seed}); {len(failures)} failures:")
    for result in failures:
        print(f"  {result.case} {result.outcome}: {result.detail[:240]}")
    header, rows = table(results)
    return {
        "seed": args.seed,
        "cases": len(results),
        "wall_s": wall,
        "timeout_s": args.timeout_s,
        "memory_mb": args.memory_mb,
        "table": [dict(zip(header, row, strict=True)) for row in rows],
        "failures": [vars(r) for r in failures],
        "load_average": os.getloadavg(),
    }


def main() -> None:
    args = arguments()
    result = run(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
