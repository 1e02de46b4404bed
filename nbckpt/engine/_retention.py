"""Which committed steps to keep, one rule for the run, the mirror and the integrations: as
Orbax v1's preservation policies, a policy is told every committed step (with its metrics) and
answers which to keep; :class:`AnyOf` combines them; ``keep=3`` is :class:`LatestN` ``(3)``.
Whoever deletes (the ``Retainer`` after each commit, the mirror after each upload) asks
:func:`doomed`, the one retention decision of a store: the run's directory and its mirror keep
the same steps. Decisions only: the thread that applies them is ``_retainer.Retainer``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from .._errors import CheckpointError, ConfigError
from .._util import check_count
from ._store import Store

__all__ = [
    "AnyOf",
    "BestN",
    "CustomSteps",
    "EveryNSteps",
    "LatestN",
    "RetentionPolicy",
    "StepFacts",
    "StepInfo",
    "check_metrics",
    "doomed",
    "expired",
    "listed",
    "policy_of",
    "top_names",
]


@dataclass(frozen=True)
class StepInfo:
    """A committed step as a policy sees it."""

    step: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    """What ``Checkpointer.save(..., metrics=...)`` was given for this step (empty if nothing)."""


@runtime_checkable
class RetentionPolicy(Protocol):
    """Decides which committed steps stay; every other one may be deleted."""

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        """The steps of ``steps`` (oldest first) to keep."""
        ...


@dataclass(frozen=True)
class LatestN:
    """The newest ``n`` steps."""

    n: int
    uses_metrics = False

    def __post_init__(self) -> None:
        check_count(self.n, "LatestN's n")

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return {info.step for info in steps[-self.n :]}

    def __str__(self) -> str:
        return f"the newest {self.n}"


@dataclass(frozen=True)
class EveryNSteps:
    """Every step that is a multiple of ``n`` (a long-term history beside the latest few)."""

    n: int
    uses_metrics = False

    def __post_init__(self) -> None:
        check_count(self.n, "EveryNSteps's n")

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return {info.step for info in steps if info.step % self.n == 0}

    def __str__(self) -> str:
        return f"every multiple of {self.n}"


@dataclass(frozen=True)
class BestN:
    """The ``n`` steps with the best value of ``metric`` (``"min"`` or ``"max"``); a step saved
    without that metric, or with NaN, is never among them. Ties go to the newer step."""

    metric: str
    n: int
    mode: Literal["min", "max"] = "min"
    uses_metrics = True

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise ConfigError(f"BestN's metric must be a metric's name, not {self.metric!r}")
        check_count(self.n, "BestN's n")
        if self.mode not in ("min", "max"):
            raise ConfigError(f"BestN's mode must be 'min' or 'max', not {self.mode!r}")

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        sign = 1.0 if self.mode == "min" else -1.0
        scored = [
            (sign * value, -info.step)
            for info in steps
            if isinstance(value := info.metrics.get(self.metric), (int, float)) and not math.isnan(value)
        ]
        return {-negative for _, negative in sorted(scored)[: self.n]}

    def __str__(self) -> str:
        return f"the {self.n} of {'least' if self.mode == 'min' else 'most'} {self.metric}"


@dataclass(frozen=True)
class CustomSteps:
    """The steps ``steps`` names: a fixed set, or a function asked each time (the steps a
    framework still refers to, such as Lightning's top-k and last checkpoints)."""

    steps: Iterable[int] | Callable[[], Iterable[int]]
    uses_metrics = False

    def __post_init__(self) -> None:
        # Checked here, not at the first save's retention pass in the background, where an error
        # is only logged, at every save (CustomSteps(5) for CustomSteps([5])).
        if callable(self.steps):
            return
        if isinstance(self.steps, (str, bytes)) or not isinstance(self.steps, Iterable):
            raise ConfigError(
                f"CustomSteps wants step numbers or a function returning them, not {self.steps!r}"
            )
        # read once: a generator would give its steps to the first pass only
        named = frozenset(check_count(step, "CustomSteps' steps", minimum=0) for step in self.steps)
        object.__setattr__(self, "steps", named)

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        named = set(self.steps() if callable(self.steps) else self.steps)
        return {info.step for info in steps if info.step in named}

    def __str__(self) -> str:
        return "the steps named" if callable(self.steps) else f"steps {sorted(self.steps)}"


@dataclass(frozen=True)
class AnyOf:
    """A step stays if any of ``policies`` keeps it (``AnyOf(LatestN(3), EveryNSteps(1000))``)."""

    policies: tuple[RetentionPolicy, ...]

    def __init__(self, *policies: RetentionPolicy) -> None:
        if not policies:  # would keep nothing but the newest step
            raise ConfigError("AnyOf needs at least one policy, e.g. AnyOf(LatestN(3), EveryNSteps(1000))")
        for policy in policies:
            _check(policy)
        object.__setattr__(self, "policies", policies)

    @property
    def uses_metrics(self) -> bool:
        return any(_uses_metrics(policy) for policy in self.policies)

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return set().union(*(policy.keep(steps) for policy in self.policies))

    def __str__(self) -> str:
        return " and ".join(str(policy) for policy in self.policies)


def _uses_metrics(policy: RetentionPolicy) -> bool:
    """Whether ``policy`` looks at metrics (a policy of the caller's own is assumed to)."""
    return bool(getattr(policy, "uses_metrics", True))


def _check(policy: object) -> RetentionPolicy:
    if isinstance(policy, (bool, type)) or not isinstance(policy, RetentionPolicy):
        raise ConfigError(
            f"keep must be a number of steps, a retention policy (LatestN, BestN, ...) or None, "
            f"not {policy!r}"
        )
    return policy


def policy_of(keep: int | RetentionPolicy | None) -> RetentionPolicy | None:
    """The policy ``keep`` stands for: a number is the newest that many; None keeps all."""
    if keep is None:
        return None
    if isinstance(keep, int) and not isinstance(keep, bool):
        return LatestN(check_count(keep, "keep (or None to keep all)"))
    return _check(keep)


def expired(policy: RetentionPolicy | None, steps: Sequence[StepInfo], *, newest: int) -> list[int]:
    """The steps of ``steps`` that ``policy`` does not keep, oldest first; never ``newest``, the
    step just committed, which the policy sees as the latest whatever its number, nor a step
    above it: a loop that starts over at step 10 beside steps 20 and 30 keeps all three until it
    passes them (it deleted 20: ``keep=1`` and step 15 saved beside 20 deleted 20), and a thread
    whose step 2 commits after another's step 3 never deletes 3."""
    if policy is None:
        return []
    ordered = sorted((info for info in steps if info.step < newest), key=lambda info: info.step)
    ordered += [info for info in steps if info.step == newest][:1]
    kept = policy.keep(ordered)
    return [info.step for info in ordered if info.step not in kept and info.step != newest]


def top_names(tree: Mapping[str, Any]) -> tuple[str, ...]:
    """The names a state tree holds at its top (``("model", "optim", "step")``), sorted."""
    return tuple(sorted(str(key) for key, _ in tree.get("items", [])))


def listed(names: Sequence[str]) -> str:
    """``'model', 'optim'``, or ``nothing``: the names a step holds, in messages."""
    return ", ".join(repr(n) for n in names) or "nothing"


class StepFacts:
    """What retention needs to know of each committed step of one line: the names at the top of
    its state and its metrics, as saved, or read once from its manifest."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._known: dict[int, tuple[tuple[str, ...], Mapping[str, float]] | None] = {}
        self._lock = threading.Lock()

    def saved(self, step: int, tree: Mapping[str, Any], metrics: Mapping[str, float]) -> None:
        with self._lock:
            self._known[step] = (top_names(tree), dict(metrics))

    def names(self, step: int) -> tuple[str, ...] | None:
        """The top-level names ``step`` holds (None if it cannot be read)."""
        facts = self._of(step)
        return facts[0] if facts else None

    def metrics(self, step: int) -> Mapping[str, float]:
        facts = self._of(step)
        return facts[1] if facts else {}

    def slip(
        self,
        step: int,
        tree: Mapping[str, Any],
        tensors: bool,
        committed: Iterable[int],
        policy: RetentionPolicy | None,
    ) -> str | None:
        """What is most often a slip about a save of ``tree`` as ``step``: other names than the
        newest step holds (``%ckpt_async x`` in a model's run), or no tensor at all. Retention
        keeps ``policy``'s steps of each set of names, so it never rotates the others out."""
        names = top_names(tree)
        latest = max((s for s in committed if s != step), default=None)
        before = self.names(latest) if latest is not None else None
        if before is not None and names != before:
            kept = f"; retention keeps {policy} of each" if policy else ""
            return (
                f"step {step} holds {listed(names)}, the newest step ({latest}) holds {listed(before)}{kept}"
            )
        return None if tensors else f"step {step} holds no tensor ({listed(names)})"

    def infos(self, policy: RetentionPolicy | None, steps: Iterable[int]) -> list[StepInfo]:
        """``steps`` as ``policy`` sees them, oldest first (metrics only if it looks at them; a
        step whose manifest cannot be read has none: it is no best one, nor deleted for that)."""
        wanted = policy is not None and _uses_metrics(policy)
        return [StepInfo(step, self.metrics(step) if wanted else {}) for step in sorted(steps)]

    def _of(self, step: int) -> tuple[tuple[str, ...], Mapping[str, float]] | None:
        with self._lock:
            if step in self._known:
                return self._known[step]
        location = self.store.committed_at(step)
        try:
            manifest = self.store.read_manifest(step, location)[0] if location else None
        except CheckpointError:
            manifest = None
        facts = (top_names(manifest.tree(0)), manifest.metrics) if manifest else None
        with self._lock:
            self._known[step] = facts
        return facts


def doomed(
    policy: RetentionPolicy | None, facts: StepFacts, newest: int, older: Iterable[int] | None = None
) -> list[int]:
    """The steps of ``facts``' store to delete once ``newest`` has committed, oldest first: of the
    steps committed before it (``older``; all its steps if None), those holding
    ``newest``'s top-level names (a stray save never rotates out the run's real ones, nor they
    it) that ``policy`` does not keep; never ``newest``. The run and its mirror both ask this."""
    if policy is None:
        return []
    names = facts.names(newest)
    before = None if older is None else set(older)
    steps = [
        s
        for s in facts.store.committed()
        if (before is None or s in before or s == newest) and facts.names(s) == names
    ]
    return expired(policy, facts.infos(policy, steps), newest=newest)


def check_metrics(metrics: Any) -> dict[str, float]:
    """``metrics`` given to a save as a dict of names to floats, NaN and infinities left out (a
    diverged loss ranks no step; JSON has no such numbers); ConfigError naming a bad entry."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise ConfigError(f"metrics must be a dict of names to numbers, not {type(metrics).__name__}")
    checked: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"metrics: {name!r}: {value!r} is not a name and a number")
        if math.isfinite(value):
            checked[name] = float(value)
    return checked
