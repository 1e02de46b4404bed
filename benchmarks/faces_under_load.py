"""The bench's faces with their defaults, once on the machine as it is and once beside a core
that another process keeps busy (the load average before each run is recorded): the Lab
(``Lab()``, run from Python as its Run button does), ``%ckpt_bench --size-mb 64 --strategies
torch-save,nbckpt-async`` (the README's example, in an IPython shell, as a batch run) and
``make report`` (``nbckpt report`` with the Makefile's parameters). Each row is the face's own
table: the overhead against ``none``, its 95 % interval, the per-repeat overheads and what the
row rests on.

    .venv/bin/python benchmarks/faces_under_load.py --json data/results/faces-under-load-cpu.json
    .venv/bin/python benchmarks/faces_under_load.py --quick     # small runs: checks the script
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from nbckpt import bench  # noqa: E402
from nbckpt.notebook import Lab  # noqa: E402
from tests.helpers.load import spinning_core  # noqa: E402  (the busy-machine test's spinner)

#: The Makefile's report parameters (``make report`` without REPORT_PARAMS).
REPORT_PARAMS = "-p preset small -p steps 12 -p every 4 -p repeats 3 -p torch_threads 1"
BENCH_MAGIC = "--size-mb 64 --strategies torch-save,nbckpt-async"
SHOWN = (
    "strategy",
    "overhead",
    "95 % interval",
    "per repeat",
    "rests on",
    "mean step s",
    "stall s",
    "save stall s",
    "wait for the earlier save s",
)


def lab_default(directory: Path, quick: bool) -> bench.Comparison:
    lab = Lab(directory=str(directory), **({"size_mb": 2.0, "steps": 8} if quick else {}))
    try:
        assert lab.run(), lab.error
        lab.wait()
        assert lab.comparison is not None, lab.error
        return lab.comparison
    finally:
        lab.close()


def ckpt_bench_magic(directory: Path, quick: bool) -> bench.Comparison:
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("load_ext", "nbckpt")
    options = "--size-mb 2 --steps 8 --strategies torch-save,nbckpt-async" if quick else BENCH_MAGIC
    with contextlib.redirect_stdout(io.StringIO()):  # a terminal shell prints the figures' reprs
        found = shell.run_line_magic("ckpt_bench", f"{options} --static --quiet --dir {directory}")
    assert isinstance(found, bench.Comparison), found
    return found


def make_report(directory: Path, quick: bool) -> bench.Comparison:
    params = "-p size_mb 2 -p steps 8 -p every 4 -p repeats 2 -p torch_threads 1" if quick else REPORT_PARAMS
    subprocess.run(
        [
            str(Path(sys.executable).parent / "nbckpt"),
            "report",
            "--name",
            "faces",
            "--output-dir",
            str(directory),
            *shlex.split(params),
            "-p",
            "target",
            str(directory / "ckpt"),
        ],
        check=True,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    document = json.loads((directory / "results.json").read_text())["comparison"]
    return bench.Comparison.from_dict(document)


FACES: dict[str, Callable[[Path, bool], bench.Comparison]] = {
    "Lab()": lab_default,
    f"%ckpt_bench {BENCH_MAGIC}": ckpt_bench_magic,
    "make report": make_report,
}


@contextlib.contextmanager
def condition(name: str) -> Iterator[None]:
    if name == "no added load":
        yield
    else:
        with spinning_core():
            yield


def run(args: argparse.Namespace) -> dict[str, Any]:
    pd.set_option("display.width", 250)
    runs = []
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        for face, measure in FACES.items():
            for name in ("no added load", "beside a spinning core"):
                load_before = os.getloadavg()[0]
                started = time.perf_counter()
                with condition(name):
                    comparison = measure(Path(scratch) / f"{len(runs)}", args.quick)
                table = bench.format_results(comparison.results)
                shown = table[[c for c in SHOWN if c in table.columns]]
                print(
                    f"\n== {face}, {name} (load average {load_before:.1f} before, "
                    f"{time.perf_counter() - started:.0f} s)"
                )
                print(shown.to_string(index=False))
                runs.append(
                    {
                        "face": face,
                        "condition": name,
                        "load_average_before": load_before,
                        "wall_s": time.perf_counter() - started,
                        "table": shown.to_dict(orient="records"),
                        "results": comparison.to_dict()["results"],
                    }
                )
    return {"runs": runs, "environment": bench.environment("cpu")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where the runs write (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="small runs: checks the script")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    result = run(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
