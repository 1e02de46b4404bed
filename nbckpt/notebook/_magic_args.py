"""How the magics read their line: argparse parsers whose ``--help`` is plain text, and the
argument types and options several magics share."""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

from IPython.core.magic import line_magic
from IPython.core.magic_arguments import MagicArgumentParser
from IPython.utils.text import dedent

from .._util import check_count, parse_duration

__all__ = [
    "AUTOSAVE_ARGS",
    "BENCH_DIR",
    "DIR_ARG",
    "SAVE_ARGS",
    "arg",
    "bench_parser",
    "duration",
    "keep_value",
    "magic",
    "positive",
    "step_value",
]

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
Argument = tuple[tuple[str, ...], dict[str, Any]]


class _Decorator(Protocol):
    def __call__(self, func: F, /) -> F: ...


def _parser(name: str, doc: str | None) -> MagicArgumentParser:
    """A plain-text argparse parser for ``%name`` (IPython's default formats help as reST)."""
    parser: MagicArgumentParser = MagicArgumentParser(  # type: ignore[no-untyped-call]
        f"%{name}",
        description=dedent(doc or "").strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-h", "--help", action="store_true", help="show this help and do nothing")
    return parser


def magic(
    *arguments: Argument, parser: Callable[[str | None], MagicArgumentParser] | None = None
) -> _Decorator:
    """A line magic (registered as IPython's ``@line_magic`` does) taking parsed arguments:
    ``--help`` prints the help; bad input is a UsageError.

    ``arguments`` are :func:`arg` pairs; ``parser(docstring)`` builds the whole parser instead
    (on first use, so that a heavy import waits until the magic runs). The help becomes the
    magic's docstring when the extension loads.
    """

    def decorate(func: F) -> F:
        @functools.cache
        def build() -> MagicArgumentParser:
            if parser is not None:
                return parser(func.__doc__)
            built = _parser(func.__name__, func.__doc__)
            for flags, options in arguments:
                built.add_argument(*flags, **options)
            return built

        @functools.wraps(func)
        def wrapper(self: Any, line: str) -> Any:
            if any(token in ("-h", "--help") for token in line.split()):
                print(build().format_help())
                return None
            args: argparse.Namespace = build().parse_argstring(line)  # type: ignore[no-untyped-call]
            return func(self, args)

        wrapper.parser = build  # type: ignore[attr-defined]
        return cast(F, line_magic(wrapper))

    return decorate


def arg(*flags: str, **options: Any) -> Argument:
    """One ``add_argument`` call, for :func:`magic`."""
    return flags, options


def _typed(parse: Callable[[str], T], what: str) -> Callable[[str], T]:
    """An argparse type: ``parse(text)``, else "must be WHAT, not 'text'" (argparse adds the flag)."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError:  # ConfigError is one
            raise argparse.ArgumentTypeError(f"must be {what}, not {text!r}") from None

    return convert


positive = _typed(lambda text: check_count(int(text), "value"), "a positive integer")
step_value = _typed(lambda text: check_count(int(text), "value", minimum=0), "a non-negative integer")
#: ``--keep``: a positive integer, or ``none`` for keeping everything.
keep_value = _typed(
    lambda text: None if text.lower() in ("none", "all") else check_count(int(text), "value"),
    "a positive integer or 'none'",
)
#: A duration: ``30s``, ``10min``, ``1h`` or plain seconds.
duration = _typed(parse_duration, "a duration such as 30s, 10min or 1h")


DIR_ARG = arg("-d", "--dir", help="checkpoint directory or s3:// URL (default: the one %%ckpt_config shows)")
#: The arguments of ``%ckpt_async`` and ``%ckpt_sync``.
SAVE_ARGS = (
    DIR_ARG,
    arg("--step", type=step_value, help="step number (default: one past the newest step in the directory)"),
    arg(
        "--keep",
        type=keep_value,
        default=argparse.SUPPRESS,
        metavar="K",
        help="keep only the newest K checkpoints of this directory, 'none' keeps all "
        "(default: %%ckpt_config's keep)",
    ),
    arg(
        "--overwrite",
        action="store_true",
        help="replace the step if it exists, without a warning (re-running a cell's save)",
    ),
    arg(
        "names",
        nargs="+",
        metavar="NAME",
        help="notebook variables to save: modules, optimizers, tensors, dicts, plain values",
    ),
)


#: Where ``%ckpt_bench`` writes without ``-d``: a folder of this user's in the temp directory.
BENCH_DIR = os.path.join(tempfile.gettempdir(), f"nbckpt-bench-{os.getuid()}")

#: The arguments of ``%ckpt_autosave``.
AUTOSAVE_ARGS = (
    arg(
        "names",
        nargs="*",
        metavar="NAME",
        help="notebook variables to autosave (none: show the running autosave)",
    ),
    arg(
        "--every",
        type=duration,
        metavar="DURATION",
        help="time between autosaves, checked as each cell ends: 30s, 10min, 1h (default: 10min)",
    ),
    arg(
        "--mtbf",
        type=duration,
        metavar="DURATION",
        help="save as often as a save schedule advises for this MTBF (8h) and the measured save "
        "costs, instead of --every",
    ),
    arg(
        "--step",
        metavar="VAR",
        help="variable holding the step number, saved with the state "
        "(default: one past the newest step in the directory)",
    ),
    DIR_ARG,
    arg(
        "--timeout",
        type=duration,
        metavar="DURATION",
        help="longest final save on kernel shutdown, restart or SIGTERM (default: 20s)",
    ),
    arg("--off", action="store_true", help="stop autosaving"),
)


@functools.cache
def bench_parser(doc: str | None) -> MagicArgumentParser:
    """``%ckpt_bench``'s parser: ``nbckpt bench``'s options plus ``--ranks`` and ``--static``."""
    from ..bench import _internal as bench

    parser = _parser("ckpt_bench", doc)
    bench.add_bench_arguments(parser)
    # Not nbckpt bench's relative default: a notebook's kernel runs in the notebook's folder,
    # and a benchmark's checkpoints do not belong beside the notebooks (nor in git status).
    parser.set_defaults(dir=BENCH_DIR)
    parser.add_argument(
        "--ranks",
        type=positive,
        default=1,
        metavar="N",
        help="run on N local ranks, torchrun started as a child process (one rank per GPU "
        "with --device cuda, else CPU processes), every rank's events streamed into the "
        "timeline as they come; Stop or Kernel > Interrupt ends every rank (default: "
        "%(default)s, in this kernel)",
    )
    parser.add_argument(
        "--static",
        action="store_true",
        help="run in the foreground and show static figures, as in batch runs "
        "(default: live lab in JupyterLab)",
    )
    return parser
