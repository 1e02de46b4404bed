"""Which committed steps to keep: retention policies, one rule for the saver, the mirror and
the integrations.

In the manner of Orbax v1's preservation policies: a policy is told every committed step (with
the metrics its save was given) and answers which of them to keep; policies combine with
:class:`AnyOf`. ``keep=3`` is :class:`LatestN` ``(3)``. Whoever deletes (the saver after each
commit, the mirror after each upload) asks :func:`expired`, so a rule is written once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from .._errors import CheckpointError, ConfigError
from .._util import check_count
from ._reader import Readable, read_manifest

__all__ = [
    "AnyOf",
    "BestN",
    "CustomSteps",
    "EveryNSteps",
    "LatestN",
    "RetentionPolicy",
    "StepInfo",
    "expired",
    "policy_of",
    "step_infos",
]


@dataclass(frozen=True)
class StepInfo:
    """A committed step as a policy sees it."""

    step: int
    metrics: Mapping[str, float | None] = field(default_factory=dict)
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
    step just committed, which the policy sees as the latest whatever its number (a loop that
    starts over at step 10 keeps 10 and the newest others)."""
    if policy is None:
        return []
    ordered = sorted((info for info in steps if info.step != newest), key=lambda info: info.step)
    ordered += [info for info in steps if info.step == newest][:1]
    kept = policy.keep(ordered)
    return [info.step for info in ordered if info.step not in kept and info.step != newest]


def step_infos(
    policy: RetentionPolicy | None,
    store: Readable,
    steps: Iterable[int],
    known: Mapping[int, Mapping[str, float | None]] | None = None,
) -> list[StepInfo]:
    """``steps`` of ``store`` as ``policy`` sees them, oldest first: their metrics read from
    their manifests (or taken from ``known``) only when the policy looks at metrics. A manifest
    that cannot be read gives no metrics (the step is no best one, and is not deleted for that)."""
    wanted = policy is not None and _uses_metrics(policy)
    known = known or {}
    return [
        StepInfo(step, (known[step] if step in known else _metrics_in(store, step)) if wanted else {})
        for step in sorted(steps)
    ]


def _metrics_in(store: Readable, step: int) -> Mapping[str, float | None]:
    location = store.committed_at(step)
    try:
        found = read_manifest(store, step, location)[0].body.get("metrics") if location else None
    except CheckpointError:
        return {}
    return found if isinstance(found, dict) else {}
