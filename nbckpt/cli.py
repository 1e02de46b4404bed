"""The nbckpt command line: one parser for every subcommand, each a thin face over the Python API.

nbckpt bench --dir data/checkpoints/bench --preset tiny --json out.json
nbckpt probe /mnt/flashblade
nbckpt diff data/checkpoints/run1 100 200 --top 10
python -m nbckpt --help
"""

from __future__ import annotations

import argparse
import glob
import inspect
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from ._errors import CheckpointError, ConfigError, NbckptError, require_extra
from ._util import check_count, format_bytes, is_url, parse_value
from .engine._internal import MANIFEST, write_atomic

__all__ = ["COMMANDS", "build_parser", "main"]


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    from .bench._internal import add_bench_arguments  # shared with %ckpt_bench

    add_bench_arguments(parser)
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the last repeat's checkpoints under --dir, to inspect or restore "
        "them (default: remove every run's checkpoints after it)",
    )
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="under torchrun: shard the GPT preset over the ranks with FSDP2, each "
        "rank saving its shard (default: replicated on every rank, as under DDP)",
    )
    parser.add_argument(
        "--ranks",
        default=None,
        metavar="N,N,...",
        help="measured scaling on this node: run the bench under torchrun on each "
        "rank count in turn (e.g. 1,2,4) and print one table of every size; --json "
        "OUT holds every size, each size's own beside it as OUT.ranks-N.json "
        "(default: the ranks this process was started with)",
    )
    parser.add_argument(
        "--events",
        action="store_true",
        help="stream every event and progress line as JSON lines on stdout, everything "
        "else printed going to stderr (what %%ckpt_bench --ranks N reads from each rank; "
        "default: no stream)",
    )


#: The signals ``nbckpt bench`` takes as Ctrl-C, so that what a Ctrl-C cleans up is cleaned up:
#: its checkpoints removed, a sweep's torchrun and ranks ended (torchrun runs in a session of its
#: own: a scheduler's SIGTERM or a closed terminal's SIGHUP to this process never reaches it, and
#: with the default action this process died at once, leaving it and its ranks running). Under
#: torchrun, each rank: torchrun ends its ranks with SIGTERM (a rank that died, a sweep's Stop).
TERMINATIONS = (signal.SIGTERM, signal.SIGHUP)
_taken: list[signal.Signals] = []  # those received, the last one the process's exit status


def _take_as_interrupt(signum: int, frame: FrameType | None) -> None:
    _taken.append(signal.Signals(signum))
    raise KeyboardInterrupt


@contextmanager
def _terminations_as_interrupt() -> Iterator[None]:
    """:data:`TERMINATIONS` raise KeyboardInterrupt while the command runs (on the main thread:
    only there can a handler be set), the handlers before restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {signum: signal.signal(signum, _take_as_interrupt) for signum in TERMINATIONS}
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def _bench(args: argparse.Namespace) -> int:
    """``nbckpt bench``: run, print the table, write JSON."""
    with _terminations_as_interrupt():
        return _bench_command(args)


def _bench_command(args: argparse.Namespace) -> int:
    from .bench import _internal as bench

    progress = None if args.quiet else lambda line: print(line, file=sys.stderr, flush=True)
    if args.ranks is not None:
        return _bench_sweep(args, progress)
    if args.fsdp and not bench.in_torchrun():
        raise ConfigError("--fsdp shards the model over the ranks of torchrun; run under torchrun")
    if not args.events:
        return _bench_run(args, progress, None)
    writer = bench.EventWriter.on_stdout()  # stdout is the events' from here on; progress goes there too
    try:
        return _bench_run(args, None if args.quiet else writer.line, writer.event)
    finally:
        writer.close()  # what the reader has not taken yet, it is given a while to


def _bench_run(
    args: argparse.Namespace, progress: Callable[[str], None] | None, on_event: Callable[[Any], None] | None
) -> int:
    """``nbckpt bench`` in this process: as one rank of torchrun's, or alone."""
    from .bench import _internal as bench

    if bench.in_torchrun():  # one rank of many: rank 0 alone prints and writes the results
        ranked = bench.run_bench_on_ranks(args, progress, on_event)
        if ranked is None:
            return 0
        comparison = ranked
    else:
        comparison = bench.run_bench_from_args(args, progress, on_event=on_event)
    if not args.events:  # with --events, the reader of the stream shows the results
        print(comparison.table())
    if args.json is not None:
        comparison.to_json(args.json)
        print(f"results written to {args.json}")
    return 0


def _bench_sweep(args: argparse.Namespace, progress: Callable[[str], None] | None) -> int:
    """``nbckpt bench --ranks 1,2,4``: torchrun launched per size, one table and one JSON of all."""
    from .bench import _internal as bench

    if bench.in_torchrun():
        raise ConfigError("--ranks launches torchrun itself; run it outside torchrun")
    if args.json is not None:
        bench.check_json_path(args.json)
    document = bench.run_sweep(args, progress)
    print(bench.scaling_table(document["scaling"]))
    if args.json is not None:
        bench.write_document(document, args.json)
        print(f"results written to {args.json}")
    return 0


def _storage_arguments(parser: argparse.ArgumentParser) -> None:
    """``--endpoint-url`` and ``--option``: how to reach an s3:// target."""
    parser.add_argument(
        "--endpoint-url", default=None, help="S3 endpoint (default: AWS_ENDPOINT_URL, else AWS's own)"
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra fsspec storage option, repeatable (VALUE parsed as JSON if it can be; default: none)",
    )


def _storage_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--option wants KEY=VALUE, not {item!r}")
        options[key] = parse_value(value)
    if args.endpoint_url:
        options["endpoint_url"] = args.endpoint_url
    return options


def _probe_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``nbckpt probe``; their defaults are :func:`nbckpt.bench.probe`'s own."""
    from . import bench

    defaults = {name: p.default for name, p in inspect.signature(bench.probe).parameters.items()}
    parser.add_argument("target", help="directory (local, NFS, tmpfs...) or s3://bucket/prefix")
    parser.add_argument(
        "--size-mb",
        type=float,
        default=defaults["size_mb"],
        help="MiB written and read per stream count (default %(default)s)",
    )
    parser.add_argument(
        "--streams",
        default=",".join(map(str, defaults["streams"])),
        help="parallel stream counts, comma separated (default %(default)s)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=defaults["repeats"],
        help="rounds per stream count; the fastest counts (default %(default)s)",
    )
    parser.add_argument(
        "--checkpoint-gb",
        type=float,
        default=None,
        help="checkpoint size in GB, for free-space and persist-time advice "
        "(default: none, that advice is left out)",
    )
    _storage_arguments(parser)
    parser.add_argument(
        "--json",
        dest="json_out",
        default=None,
        metavar="OUT",
        help="also write the full result as JSON to OUT (default: no file)",
    )


def _probe(args: argparse.Namespace) -> int:
    """``nbckpt probe``: measure, print the summary, write JSON."""
    from . import bench

    try:
        streams = [int(part) for part in str(args.streams).split(",") if part.strip()]
    except ValueError as exc:
        raise ConfigError(f"--streams wants comma separated integers, not {args.streams!r}") from exc
    checkpoint = int(args.checkpoint_gb * 1e9) if args.checkpoint_gb is not None else None
    result = bench.probe(
        args.target,
        size_mb=args.size_mb,
        streams=streams,
        repeats=args.repeats,
        storage_options=_storage_options(args),
        checkpoint_bytes=checkpoint,
    )
    if args.json_out:  # before printing: a closed stdout must not lose the measurement
        write_atomic(args.json_out, json.dumps(result.to_dict(), indent=1, default=str).encode())
    print(result.summary())
    if args.json_out:
        print(f"wrote {args.json_out}")
    return 0


def _report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--name", default="report", help="file name of the report, without .html (default: %(default)s)"
    )
    parser.add_argument(
        "--output-dir",
        default="reports",
        help="folder for NAME.html, NAME.ipynb and results.json (default: %(default)s)",
    )
    parser.add_argument(
        "-p",
        "--parameter",
        nargs=2,
        action="append",
        default=[],
        metavar=("KEY", "VALUE"),
        help="set a parameter of the report notebook, repeatable, e.g. -p target "
        "/mnt/fb -p preset small; the names and their defaults are the first cell "
        "of notebooks/report.ipynb (default: the notebook's own)",
    )
    parser.add_argument(
        "--notebook", default=None, help="another report notebook to run (default: notebooks/report.ipynb)"
    )
    parser.add_argument(
        "--from",
        dest="sources",
        nargs="+",
        default=None,
        metavar="JSON",
        help="measure nothing: build NAME.html from these results of nbckpt bench "
        "under torchrun (a cluster's; several rank counts give the scaling curve) "
        "(default: run the notebook)",
    )
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=10.0,
        help="the time budget: a run estimated to take longer, or on a machine too busy "
        "to measure, is shortened to fewer repeats and steps (default: %(default)g)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="run the repeats and steps asked for even over the budget or on a busy "
        "machine (default: shorten, and say so)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="say the estimate, the load and what would run, then stop (default: run)",
    )


def _report(args: argparse.Namespace) -> int:
    """``nbckpt report``: run the notebook, write the HTML and say where the results are."""
    from .bench import _internal as bench
    from .notebook._internal import (
        REPORT_NOTEBOOK,
        RESULTS_FILE,
        notebook_defaults,
        plan_report,
        report_from,
        run_report,
    )

    if args.sources is not None:
        if args.parameter or args.notebook:
            raise ConfigError("--from measures nothing: it takes no -p or --notebook")
        print(f"wrote {report_from(args.sources, args.name, args.output_dir)}")
        return 0
    if not 0 < args.max_minutes < math.inf:
        raise ConfigError(f"--max-minutes must be a positive number of minutes, not {args.max_minutes:g}")
    parameters = {key: parse_value(value) for key, value in args.parameter}
    source = Path(args.notebook) if args.notebook is not None else REPORT_NOTEBOOK
    load_1m, cores = bench.machine_load()
    # Said before anything is measured: a run that cannot mean much is shortened, not sat through.
    plan = plan_report(
        parameters,
        notebook_defaults(source) if source.is_file() else {},
        load_1m=load_1m,
        cores=cores,
        max_minutes=args.max_minutes,
        full=args.full,
    )
    for line in plan.lines:
        print(line, file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    html = run_report(args.name, args.output_dir, plan.parameters, notebook=args.notebook, progress=True)
    print(f"results: {html.parent / RESULTS_FILE}")
    return 0


def _export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a step directory (run1/step-000120) or a pointer file nbckpt wrote")
    parser.add_argument("out", help="the file to write: one torch.load-able dict, values included")
    parser.add_argument(
        "--map-location", default=None, help="device for the tensors in the file (default: cpu)"
    )


def _export(args: argparse.Namespace) -> int:
    """``nbckpt export``: one ``torch.load``-able file from a checkpoint, verified on the way."""
    from .integrations import export

    print(f"wrote {export(args.source, args.out, map_location=args.map_location)}")
    return 0


def _directory_arguments(parser: argparse.ArgumentParser, **steps: str) -> None:
    """A run directory, the step arguments ``steps`` (name: help) and the storage options."""
    parser.add_argument("directory", help="a run directory (local, NFS) or s3:// URL")
    for name, help_text in steps.items():
        parser.add_argument(name, type=int, help=help_text)
    _storage_arguments(parser)


def _verify_arguments(parser: argparse.ArgumentParser) -> None:
    _directory_arguments(parser)
    parser.add_argument(
        "step", type=int, nargs="?", default=None, help="the step to verify (default: every committed step)"
    )


def _reader(args: argparse.Namespace) -> Any:
    """A read-only Checkpointer on ``args.directory``; a path that does not exist is an error (a
    typo must not read as an empty run: ``nbckpt verify DIR && deploy``)."""
    from .engine import Checkpointer

    path = str(args.directory).removeprefix("file://")
    if not is_url(args.directory) and not os.path.lexists(os.path.expanduser(path)):
        raise CheckpointError(f"{path} does not exist")
    # read-only: no lock, nothing written, so a run may be saving into the directory meanwhile
    return Checkpointer(
        args.directory,
        read_only=True,
        storage_options=_storage_options(args),
    )


def _nothing_in(url: str) -> str:
    """ "no committed checkpoint in URL", naming the runs inside it when it is a parent of runs."""
    line = f"no committed checkpoint in {url}"
    pattern = os.path.join(glob.escape(url), "*", "step-*", MANIFEST)
    manifests = [] if is_url(url) else glob.glob(pattern, include_hidden=True)  # Lightning's .nbckpt
    runs = sorted({os.path.basename(os.path.dirname(os.path.dirname(path))) for path in manifests})
    if runs:
        line += f"; it holds runs: {', '.join(runs)} (nbckpt ls {os.path.join(url, runs[0])})"
    return line


def _ls(args: argparse.Namespace) -> int:
    """``nbckpt ls``: every committed step, when it was written, its size and where it came from;
    then the runs set aside inside it after a rewind, each with its path (``nbckpt ls PATH``)."""
    with _reader(args) as ckpt:
        steps = ckpt.steps()
        if not steps:
            print(_nothing_in(ckpt.store.url))
        else:
            print(f"{'step':>10}  {'written (UTC)':19}  {'size':>9}  {'tensors':>7}  program")
        for step in steps:
            manifest = ckpt.manifest(step)
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(manifest["unix_time"]))
            print(
                f"{step:>10}  {when}  {format_bytes(manifest['bytes']):>9}  "
                f"{len(manifest['items']):>7}  {manifest.get('provenance', {}).get('program', '')}"
            )
        for entry in ckpt.set_aside_runs():
            kind = "a branch an earlier nbckpt started" if entry["earlier_release"] else "set aside"
            after = "" if entry["after"] is None else f" after step {entry['after']}"
            held = ", ".join(map(str, entry["steps"])) or "none"
            print(f"{kind}{after}: steps {held} in {entry['path']}")
    return 0


def _show(args: argparse.Namespace) -> int:
    """``nbckpt show``: one step: provenance, files, and every value saved beside the tensors."""
    with _reader(args) as ckpt:
        manifest = ckpt.manifest(args.step)
        values = ckpt.load(args.step, map_location="meta")  # no tensor data is read
    shown = {key: manifest[key] for key in ("step", "time", "bytes", "world_size")}
    shown["provenance"] = manifest.get("provenance", {})
    shown["files"] = {name: meta["size"] for name, meta in manifest["files"].items()}
    shown["state"] = _describe(values)
    print(json.dumps(shown, indent=1, default=str))
    return 0


def _describe(value: Any) -> Any:
    """Values as saved; tensors as their dtype and shape (they were loaded on ``meta``)."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    if isinstance(value, dict):
        return {str(key): _describe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_describe(item) for item in value]
    return value


def _diff_arguments(parser: argparse.ArgumentParser) -> None:
    _directory_arguments(parser, step_a="the earlier step", step_b="the later step")
    parser.add_argument(
        "--top",
        type=int,
        default=20,
        help="tensors to list, most changed first (default %(default)s; 0 lists all)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print JSON instead of a table (default: a table)"
    )


def _diff(args: argparse.Namespace) -> int:
    """``nbckpt diff``: which tensors changed from one step to another, and by how much."""
    from .analysis._internal import diff_states

    top = check_count(args.top, "--top", minimum=0)
    with _reader(args) as ckpt:
        # weights only, on the CPU: nothing in a checkpoint is ever unpickled
        frame = diff_states(
            ckpt.load(args.step_a, map_location="cpu"), ckpt.load(args.step_b, map_location="cpu")
        )
        url = ckpt.store.url
    counts = {str(status): int(n) for status, n in frame["status"].value_counts().items()}
    shown = frame.head(top) if top else frame
    if args.json:
        # JSON has no NaN or infinity: an undefined number (a cosine of zeros) is null
        rows = [
            {
                key: None if isinstance(value, float) and not math.isfinite(value) else value
                for key, value in row.items()
            }
            for row in shown.to_dict(orient="records")
        ]
        print(
            json.dumps(
                {
                    "directory": url,
                    "a": args.step_a,
                    "b": args.step_b,
                    "tensors": len(frame),
                    "counts": counts,
                    "rows": rows,
                },
                indent=1,
            )
        )
        return 0
    summary = ", ".join(f"{n} {status}" for status, n in counts.items()) or "no tensors"
    print(f"step {args.step_a} -> step {args.step_b} of {url}: {len(frame)} tensors ({summary})")
    if len(shown):
        print(shown.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    if len(shown) < len(frame):
        print(f"... and {len(frame) - len(shown)} more (--top 0 lists all)")
    return 0


def _verify(args: argparse.Namespace) -> int:
    """``nbckpt verify``: check every block of every file of one step, or of all; exit 1 on damage."""
    bad = 0
    with _reader(args) as ckpt:
        steps = [args.step] if args.step is not None else ckpt.steps()
        if not steps:
            raise CheckpointError(_nothing_in(ckpt.store.url))
        for step in steps:
            try:
                left_out = ckpt.verify(step).get("left_out", {})  # a plain DCP step's unreadable values
                note = f" (left out: {', '.join(left_out)}: nbckpt does not read them)" if left_out else ""
                print(f"step {step}: ok{note}")
            except CheckpointError as exc:
                bad += 1
                print(f"step {step}: {exc}")
    return 1 if bad else 0


Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
#: subcommand -> (help, add its options, run it)
COMMANDS: dict[str, Command] = {
    "bench": ("run sync and async checkpoint strategies side by side", _bench_arguments, _bench),
    "probe": ("measure what a storage path or s3:// URL can do", _probe_arguments, _probe),
    "report": ("run the report notebook and render offline HTML", _report_arguments, _report),
    "export": ("write a checkpoint as one torch.load-able file", _export_arguments, _export),
    "ls": ("list the committed steps of a run directory", _directory_arguments, _ls),
    "show": (
        "show one step: provenance, files, saved values",
        lambda parser: _directory_arguments(parser, step="the step to show"),
        _show,
    ),
    "diff": ("compare two steps tensor by tensor, most changed first", _diff_arguments, _diff),
    "verify": ("check every block of a run's checkpoints", _verify_arguments, _verify),
}
#: Commands that need a face beyond the core (and so its extra).
FACES = {
    "bench": "nbckpt.bench",
    "probe": "nbckpt.bench",
    "report": "nbckpt.notebook",
    "diff": "nbckpt.analysis",
}


def build_parser() -> argparse.ArgumentParser:
    from ._version import __version__

    parser = argparse.ArgumentParser(
        prog="nbckpt",
        description="See and fix what checkpointing costs a PyTorch training run.",
        epilog="Run 'nbckpt COMMAND --help' for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"nbckpt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_arguments, run) in COMMANDS.items():
        try:
            if name in FACES:
                require_extra(FACES[name])
        except ImportError as exc:  # the core alone: ls, show, verify and export still work
            missing = sub.add_parser(name, help=help_text, prefix_chars="\0", add_help=False)
            missing.add_argument("arguments", nargs="*")  # whatever they are: it names its extra
            line = f"nbckpt {name}: error: {exc}\n"  # one line naming the extra
            missing.set_defaults(run=lambda args, line=line, exit=missing.exit: exit(2, line))  # as argparse
            continue
        command = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(command)
        command.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, run the command; exit status 2 with one line for a user's mistake."""
    args = build_parser().parse_args(argv)
    _taken.clear()  # a command run before in this process (a test's) was ended by them
    try:
        return int(args.run(args))
    except NbckptError as exc:
        _say(f"nbckpt {args.command}: error: {exc}")
        return 2
    except KeyboardInterrupt:
        taken = _taken[-1] if _taken else None
        _say(f"nbckpt {args.command}: interrupted" + (f" by {taken.name}" if taken else ""))
        return 128 + (taken or signal.SIGINT)


def _say(line: str) -> None:
    """``line`` on stderr in one write: the ranks of torchrun share its stderr, and print's two
    writes (the text, then its newline) let their lines run into each other."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
