"""The format fuzzer (issue 34): cases of :mod:`helpers.fuzz_edits` run in child processes under a
memory limit (RLIMIT_AS) and a time limit, each case's outcome classified.

Every case copies a run of two good steps (native, or plain-DCP ``step-N/`` folders), damages step
2, and reads it three ways: ``restore()`` of the newest step into a blank state, ``load(2)`` and
``verify(2)``. Where nbckpt reads step 2, plain ``dcp.load`` must read the same. The outcome:

* ``exact``: restore gives step 2 as saved (or the edit was harmless), or the edited bytes a plain
  ``dcp.load`` reads too (a flipped data byte that no checksum covers: the edited step holds them);
* ``fallback``: restore refuses step 2 and gives step 1 exactly;
* ``error``: restore raises one line of nbckpt's errors (CheckpointError, ConfigError) and leaves
  the state as it was;
* a failure: ``crash`` (a signal), ``hang`` (past the time limit), ``raw`` (an exception outside
  nbckpt's hierarchy, or an error of many lines), ``memory`` (past the memory limit), ``bytes``
  (values neither step holds, or a failed restore that changed the state), ``disagree`` (nbckpt
  reads step 2 exactly where plain ``dcp.load`` reads it otherwise or not at all). ``load`` and
  ``verify`` must each give the step or one clear error too.

A child runs many cases (one interpreter start for all of them) and reports each as it goes; after
a crash or a hang the parent starts a new one for the cases left. ``python -m helpers.fuzz child``
is the child.
"""

from __future__ import annotations

import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helpers import ROOT
from helpers.fuzz_edits import FAMILIES, STEP_DIRS, mutate

__all__ = ["FAILURES", "OUTCOMES", "Result", "case_ids", "make_runs", "run_cases", "table"]

OUTCOMES = ("exact", "fallback", "error")
FAILURES = ("crash", "hang", "raw", "memory", "bytes", "disagree")


@dataclass
class Result:
    case: str
    outcome: str  # one of OUTCOMES or FAILURES
    detail: str  # what the edit was; for a failure, what went wrong and where

    @property
    def family(self) -> str:
        return self.case.split("/")[0]


def case_ids(cases_per_family: int, families: Iterable[str] = FAMILIES) -> list[str]:
    return [f"{family}/{n}" for n in range(cases_per_family) for family in families]


def make_runs(root: Path) -> Path:
    """``root/native`` (steps 1 and 2 nbckpt wrote) and ``root/dcp`` (the same, plain ``dcp.save``)."""
    import torch.distributed.checkpoint as dcp

    from helpers.hostile import state_of, two_steps

    two_steps(root / "native")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled": one process, as meant
        for step in (1, 2):
            dcp.save(state_of(step), checkpoint_id=root / "dcp" / f"step-{step}", no_dist=True)
    return root


# -- the parent ------------------------------------------------------------------------------------------


class Child:
    """One child process and the lines it has sent."""

    def __init__(self, runs: Path, seed: int, cases: list[str], memory_mb: int) -> None:
        path = os.pathsep.join([str(ROOT / "tests"), str(ROOT)])
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
        self.stderr = open(runs / "child-stderr.log", "ab")  # noqa: SIM115  (closed in stop())
        self.process = subprocess.Popen(
            [sys.executable, "-m", "helpers.fuzz", "child", str(runs), str(seed), str(memory_mb)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=env,
            cwd=runs,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write("\n".join(cases).encode() + b"\n")
        self.process.stdin.close()
        self.buffer = b""

    def line(self, deadline: float) -> str | None:
        """The next line, or None at the deadline or at the end of the output."""
        stdout = self.process.stdout
        assert stdout is not None
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([stdout], [], [], left)[0]:
                return None
            chunk = os.read(stdout.fileno(), 1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()

    def stop(self) -> str:
        """The child ended (killed if it still runs): how, in words."""
        if self.process.poll() is None:
            self.process.kill()
        code = self.process.wait()
        self.stderr.close()
        return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"


def run_cases(
    runs: Path,
    seed: int,
    cases: list[str],
    *,
    timeout_s: float = 20.0,
    memory_mb: int = 2048,
    batch: int = 400,
    progress: Callable[[Result], None] | None = None,
) -> list[Result]:
    """Every case in children of at most ``batch`` cases; a crash or hang ends that case, and a
    new child goes on with the rest."""
    results: list[Result] = []
    pending = list(cases)
    while pending:
        child = Child(runs, seed, pending[:batch], memory_mb)
        current, phase, what = None, "start", ""
        deadline = time.monotonic() + 120 + timeout_s  # importing torch on a busy machine
        while (line := child.line(deadline)) is not None:
            word, _, rest = line.partition(" ")
            if word == "case":
                current, phase, what, deadline = rest, "copy", "", time.monotonic() + timeout_s
            elif word == "what":
                what = rest
            elif word == "phase":
                phase = rest
            elif word == "result":
                result = Result(**json.loads(rest))
                results.append(result)
                pending.remove(result.case)
                if progress:
                    progress(result)
        timed_out = time.monotonic() >= deadline
        how = child.stop()
        if current is not None and current in pending:  # it died or hung inside this case
            outcome = "hang" if timed_out else "crash"
            detail = f"past {timeout_s:.0f} s" if timed_out else how
            results.append(Result(current, outcome, f"{what}; {detail} in {phase}"))
            pending.remove(current)
            if progress:
                progress(results[-1])
        elif pending and current is None:
            raise RuntimeError(f"the fuzz child died before any case ({how}): see {runs}/child-stderr.log")
    return results


def table(results: list[Result]) -> tuple[list[str], list[list[Any]]]:
    """Outcome counts per family (and a total row)."""
    header = ["family", "cases", *OUTCOMES, *FAILURES]
    rows = []
    by_family: dict[str, Counter[str]] = {}
    for result in results:
        by_family.setdefault(result.family, Counter())[result.outcome] += 1
    for family in [f for f in FAMILIES if f in by_family]:
        counts = by_family[family]
        rows.append([family, sum(counts.values()), *(counts[o] for o in (*OUTCOMES, *FAILURES))])
    total = Counter(r.outcome for r in results)
    rows.append(["total", len(results), *(total[o] for o in (*OUTCOMES, *FAILURES))])
    return header, rows


# -- the child ---------------------------------------------------------------------------------------------


def bits(tensor: Any) -> Any:
    import torch

    flat = tensor.detach().reshape(-1)
    return flat.view(torch.uint8) if not flat.is_quantized else flat.int_repr().view(torch.uint8)


def same(a: Any, b: Any) -> bool:
    """Equal values, tensors bit for bit (dtype and shape too, so NaN equals itself)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.device == b.device
            and torch.equal(bits(a), bits(b))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def template_of(value: Any) -> Any:
    """A blank state of ``value``'s shape for plain ``dcp.load`` (which replaces non-tensors)."""
    import torch

    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: template_of(v) for k, v in value.items()}
    return None


class Refused(Exception):
    """A reader's failure, classified: ``outcome`` is ``error`` (a clear one) or a failure."""

    def __init__(self, outcome: str, detail: str) -> None:
        super().__init__(detail)
        self.outcome, self.detail = outcome, detail


def attempt(read: Callable[[], Any]) -> Any:
    """``read()``, its exception classified as a :class:`Refused`."""
    from nbckpt import NbckptError

    try:
        return read()
    except NbckptError as exc:
        text = str(exc)
        outcome = "error" if text and "\n" not in text else "raw"
        raise Refused(outcome, f"{type(exc).__name__}: {text[:160]!r}") from None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        text = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
        memory = isinstance(exc, MemoryError) or "can't allocate memory" in str(exc)
        raise Refused("memory" if memory else "raw", text) from None


class Case:
    """One case in the child: the run copied, step 2 edited, read every way."""

    def __init__(self, runs: Path, seed: int, case: str, phase: Callable[[str], None]) -> None:
        from helpers.hostile import blank, state_of

        self.kind = case.split("-")[0]
        self.run = runs / "case"
        shutil.rmtree(self.run, ignore_errors=True)
        shutil.copytree(runs / self.kind, self.run)
        self.step_dir = self.run / STEP_DIRS[self.kind]
        self.what = mutate(self.step_dir, case, seed)
        self.saved = {step: state_of(step) for step in (1, 2)}
        self.blank = blank
        self.phase = phase
        self.as_saved: bool | None = None
        self.dcp_refusal = ""

    def dcp_reading(self, template: Any) -> Any:
        """What plain ``dcp.load`` reads from step 2 into ``template`` (None if it raises)."""
        import torch.distributed.checkpoint as dcp

        self.phase("dcp.load")
        try:
            dcp.load(template, checkpoint_id=self.step_dir, no_dist=True)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # plain DCP's errors (a BaseException): it did not read
            self.dcp_refusal = type(exc).__name__
            return None
        return template

    def check_step_2(self, value: Any, reader: str) -> None:
        """``value`` is step 2 as saved and plain DCP reads it so too, or it is what the edited files
        hold: plain DCP reads the same into a template of its shape (a flipped data byte no checksum
        covers, a key renamed everywhere, a plain-DCP value ``load`` leaves out with a warning)."""
        if same(value, self.saved[2]):
            if self.as_saved is None:
                reading = self.dcp_reading(self.blank())
                self.as_saved = reading is not None and same(reading, value)
            if not self.as_saved:
                raise Refused(
                    "disagree",
                    f"{reader} read step 2 as saved; plain dcp.load does not "
                    f"({self.dcp_refusal or 'other values'})",
                )
        elif not same(self.dcp_reading(template_of(value)), value):
            raise Refused("bytes", f"{reader} gave values neither step holds, nor plain dcp.load reads")

    def restore(self, ckpt: Any) -> str:
        state = self.blank()
        try:
            step = attempt(lambda: ckpt.restore(state))
        except Refused as refused:
            if refused.outcome == "error" and not same(state, self.blank()):
                raise Refused("bytes", f"a failed restore changed the state ({refused.detail})") from None
            raise
        if step == 1 and same(state, self.saved[1]):
            return "fallback"
        if step != 2:
            raise Refused("bytes", f"restore gave step {step} with other values")
        self.check_step_2(state, "restore")
        return "exact"

    def load(self, ckpt: Any) -> str:
        self.check_step_2(attempt(lambda: ckpt.load(2)), "load")
        return "exact"

    def verify(self, ckpt: Any) -> str:
        attempt(lambda: ckpt.verify(2))
        return "exact"

    def read(self) -> tuple[str, str]:
        """The case's outcome (restore's, or the first reader's failure) and what happened."""
        from nbckpt import Checkpointer

        outcomes, details = [], [self.what]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a fallback's warning names the damage: expected here
            self.phase("open")
            try:
                ckpt = attempt(lambda: Checkpointer(self.run, read_only=True))
            except Refused as refused:
                return refused.outcome, f"{self.what}; {refused.detail} in open"
            readers: list[tuple[str, Callable[[], str]]] = [
                ("restore", lambda: self.restore(ckpt)),
                ("load", lambda: self.load(ckpt)),
                ("verify", lambda: self.verify(ckpt)),
            ]
            try:
                for name, read in readers:
                    self.phase(name)
                    try:
                        outcomes.append(read())
                    except Refused as refused:
                        outcomes.append(refused.outcome)
                        if refused.outcome != "error":
                            details.append(f"{refused.detail} in {name}")
            finally:
                ckpt.close()
        failed = [o for o in outcomes if o not in OUTCOMES]
        return (failed[0] if failed else outcomes[0]), "; ".join(details)


def child(runs: Path, seed: int, memory_mb: int) -> None:
    """Read case ids from stdin, report each: ``case ID``, ``phase NAME``..., ``result JSON``."""
    import torch.distributed.checkpoint  # noqa: F401

    import nbckpt  # noqa: F401  (everything the readers need, before the limit is set)

    status = Path("/proc/self/status").read_text()
    virtual = int(status.split("VmSize:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (virtual + memory_mb * (1 << 20), resource.RLIM_INFINITY))

    def phase(name: str) -> None:
        print("phase", name, flush=True)

    for case in sys.stdin.read().split():
        print("case", case, flush=True)
        edited = Case(runs, seed, case, phase)
        print("what", edited.what, flush=True)
        outcome, detail = edited.read()
        print("result", json.dumps({"case": case, "outcome": outcome, "detail": detail}), flush=True)


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    child(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
