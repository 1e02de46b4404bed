"""What the Lab's runs need besides widgets: the run itself (in this kernel, or on local ranks
under torchrun), the target check, one-line errors, and Kernel > Interrupt routed to the lab
that runs. The runs never touch a widget: ``post(kind, item)`` queues what the lab shows."""

from __future__ import annotations

import signal
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from .._errors import CheckpointError, ConfigError
from .._util import could_create, is_url

if TYPE_CHECKING:
    from ..bench import Comparison
    from ..bench._internal import RankLaunch

__all__ = ["check_target", "error_line", "route_interrupts", "run_here", "run_on_ranks"]

Post = Callable[[str, Any], None]


def check_target(path: str) -> None:
    """ConfigError when ``path`` cannot hold checkpoints (URLs are not checked). Nothing is
    created: a lab that is only validated leaves no directory behind."""
    if not path.strip():
        raise ConfigError("the target path is empty")
    if not is_url(path) and (reason := could_create(path)) is not None:
        raise ConfigError(f"target {path} is not usable: {reason}")


def error_line(exc: BaseException) -> str:
    """One line for an error that ended a run."""
    if isinstance(exc, ConfigError):
        text = f"Cannot run: {exc}"
    elif isinstance(exc, CheckpointError):
        text = f"Checkpoint failed: {exc}"
    elif isinstance(exc, OSError):
        text = f"Storage error: {exc.strerror or exc}{f' ({exc.filename})' if exc.filename else ''}"
    else:
        text = f"Unexpected error: {type(exc).__name__}: {exc} (details in the log)"
    return " ".join(text.split())


# Kernel > Interrupt is a SIGINT. While a cell runs, ipykernel makes it a KeyboardInterrupt
# (Lab.wait catches it); while the kernel is idle it ignores it, so a run in the lab's threads
# would never hear of it. The handler below (installed once) tells the lab that ran last, then
# calls the one it replaced. ipykernel swaps handlers around each message it handles and puts
# back ``kernel.saved_sigint_handler`` after it: inside one (a cell, a click), ours goes there.
_previous_sigint: Any = signal.SIG_IGN
_interrupted: weakref.WeakMethod[Callable[[], None]] | None = None


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    if (note := _interrupted() if _interrupted is not None else None) is not None:
        note()
    if callable(_previous_sigint):
        _previous_sigint(signum, frame)


def route_interrupts(note: Callable[[], None]) -> None:
    """Every SIGINT from now on calls ``note`` (a bound method, held weakly) first. It must take
    no lock: a signal handler runs between two bytecodes of the main thread, which may hold any.
    Only the main thread can do this; where SIGINT ends the process, nothing changes."""
    global _previous_sigint, _interrupted
    _interrupted = weakref.WeakMethod(note)
    if threading.current_thread() is not threading.main_thread():
        return
    from IPython import get_ipython

    kernel: Any = getattr(get_ipython(), "kernel", None)  # type: ignore[no-untyped-call]
    inside = signal.getsignal(signal.SIGINT) is signal.default_int_handler and hasattr(
        kernel, "saved_sigint_handler"
    )
    current = kernel.saved_sigint_handler if inside else signal.getsignal(signal.SIGINT)
    if current is _on_sigint or current in (signal.SIG_DFL, None):
        return
    _previous_sigint = current
    if inside:
        kernel.saved_sigint_handler = _on_sigint
    else:
        signal.signal(signal.SIGINT, _on_sigint)


def run_here(
    settings: dict[str, Any],
    compute_ms: float,
    warmup: bool,
    post: Post,
    json_path: str | None,
    *,
    stop: threading.Event,
) -> Comparison:
    """The lab's comparison in this kernel (``settings``: the lab's fields, read once)."""
    from ..bench import compare, make_workload
    from ..bench._internal import choose_interval

    settings = {name: value for name, value in settings.items() if name != "ranks"}
    workload = make_workload(*settings.pop("workload"), compute_ms=compute_ms)
    if settings["every"] is None:  # measured here, so that progress knows the steps
        workload.build()
        interval = choose_interval(workload, settings["directory"], steps=settings["steps"])
        settings.update(steps=interval.steps, every=interval.every)
        post("log", interval.describe())
        post("steps", interval.steps)
    comparison = compare(
        workload,
        **settings,
        warmup=warmup,
        stop=stop,
        progress=lambda line: post("log", line),
        on_event=lambda event: post("event", event),
    )
    if json_path is not None:
        comparison.to_json(json_path)
        post("log", f"results written to {json_path}")
    return comparison


def run_on_ranks(
    settings: dict[str, Any],
    compute_ms: float,
    warmup: bool,
    post: Post,
    json_path: str | None,
    *,
    on_start: Callable[[RankLaunch], None],
) -> Comparison:
    """``nbckpt bench`` on ``settings["ranks"]`` local ranks, every rank's events and lines
    posted as they come; ``on_start`` gets the launch, to end it."""
    import argparse

    from ..bench._internal import passthrough, run_local_ranks

    preset, size_mb, device = settings["workload"]
    options = argparse.Namespace(
        dir=settings["directory"],
        preset=preset,
        size_mb=size_mb,
        device=device,
        compute_ms=compute_ms,
        strategies=",".join(settings["strategies"]),
        steps=settings["steps"],
        every=settings["every"],
        repeats=settings["repeats"],
        no_warmup=not warmup,
    )
    return run_local_ranks(
        settings["ranks"],
        passthrough(options),
        settings["directory"],
        on_event=lambda event: post("event", event),
        on_line=lambda line: post("log", line),
        on_start=on_start,
        json_path=json_path,
        device=device,
    )
