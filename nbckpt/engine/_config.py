"""Everything a Checkpointer can be told, checked once and frozen."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from .._errors import ConfigError
from .._util import check_count, check_flag, check_options
from ._retention import RetentionPolicy, policy_of
from ._schedule import SaveSchedule

__all__ = ["CheckpointConfig", "Mode"]

Mode = Literal["sync", "async"]
Ranks = Literal["auto", "all", "local"]
# Each in-flight slot holds a full host copy of the state, and each writer thread a file:
# beyond these a typo (10**9) would allocate until the OOM killer ends the kernel.
MAX_INFLIGHT = 8
MAX_WRITER_THREADS = 64


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Options of a :class:`~nbckpt.Checkpointer`; every field has a safe default. Frozen: to
    change one, make a new config (:func:`dataclasses.replace`) and open a new Checkpointer."""

    mode: Mode = "async"
    """``"async"``: ``save`` returns once the state is copied and persists in the background;
    ``"sync"``: ``save`` returns once the checkpoint has committed."""
    keep: int | RetentionPolicy | None = None
    """Which committed checkpoints to keep: a number keeps the newest that many, a policy
    (:class:`~nbckpt.LatestN`, :class:`~nbckpt.EveryNSteps`, :class:`~nbckpt.BestN`,
    :class:`~nbckpt.CustomSteps`, combined with :class:`~nbckpt.AnyOf`) decides; the others are
    deleted in the background after each commit (never the one just committed). None keeps all."""
    max_inflight: int = 1
    """Saves that may be staged or persisting at once; the next ``save`` waits (backpressure).
    Host memory for staging is ``max_inflight`` times the state size, allocated once."""
    incremental: bool = False
    """Write only what changed: a data file whose tensors all hold the bytes they held at the
    previous save is neither staged nor written again; the new step gets that step's file under
    its own name (a hard link; on an object store, a server-side copy), so every step stays a whole
    checkpoint that deleting any other never breaks. Frozen parameters of modules are grouped
    apart, so a frozen base is written once per Checkpointer. Each save fingerprints the tensors
    torch's version counter does not show as changed (docs/format.md). Needs ``max_inflight=1``."""
    verify: bool = True
    """Check the checksum of every block read on restore (and the file sizes)."""
    capture_rng: bool = False
    """Save the torch (CPU and CUDA), numpy and ``random`` RNG states; restore sets them back."""
    writer_threads: int = 2
    """Files each rank writes (and reads) in parallel, one thread each."""
    writer_nice: int = 10
    """How many steps below the caller's priority the background threads run (writes, checksums,
    uploads, deletes; Linux, 0 to 19), so that they take the CPU time training leaves; staging
    keeps the caller's. Where training keeps every core busy the newest step is durable later;
    0 runs everything at the caller's priority."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for URLs such as ``s3://`` (``endpoint_url``, ``key``, ``secret``, ...)."""
    ranks: Ranks = "auto"
    """``"all"``: every rank of the default process group saves and restores together (its
    shard of the state); ``"local"``: this process checkpoints alone, as frameworks that save
    from rank 0 only need; ``"auto"``: ``"all"`` under an initialized group of several ranks."""
    timeout_s: float = 600.0
    """Longest wait for the other ranks in one collective before the operation fails; also the
    longest a new writer waits for a Checkpointer of this process dropped unclosed on the run
    to finish its work (its uploads) before the open fails."""
    mirror: str | None = None
    """A second place (``s3://...`` or a directory) every committed step is uploaded to in the
    background, committed there too; restore falls back to it when the directory has no intact
    checkpoint. Uploads never delay a save; ``wait`` and ``close`` wait for them."""
    mirror_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for the mirror (``endpoint_url``, ``key``, ``secret``, ...)."""
    read_only: bool = False
    """Open only to read (restore, load, verify, list): no lock, no clean-up, nothing written,
    so another process may be saving into the directory meanwhile."""
    schedule: SaveSchedule | None = None
    """When to save, for :meth:`Checkpointer.due`: a :class:`~nbckpt.SaveSchedule` (the job's
    MTBF, or its size) that sets the interval from this run's measured costs."""

    def __post_init__(self) -> None:
        if self.mode not in ("sync", "async"):
            raise ConfigError(f"mode must be 'sync' or 'async', not {self.mode!r}")
        policy_of(self.keep)
        if self.schedule is not None and not isinstance(self.schedule, SaveSchedule):
            raise ConfigError(f"schedule must be a SaveSchedule (of an mtbf or gpus), not {self.schedule!r}")
        check_count(self.max_inflight, "max_inflight", maximum=MAX_INFLIGHT)
        check_count(self.writer_threads, "writer_threads", maximum=MAX_WRITER_THREADS)
        check_count(self.writer_nice, "writer_nice", minimum=0, maximum=19)
        for name in ("incremental", "verify", "capture_rng", "read_only"):
            check_flag(getattr(self, name), name)
        for name in ("storage_options", "mirror_options"):
            check_options(getattr(self, name), name)
        if self.mirror is not None and (not isinstance(self.mirror, str) or not self.mirror.strip()):
            raise ConfigError(f"mirror must be a directory or URL, not {self.mirror!r}")
        if self.mirror_options and self.mirror is None:  # the options of a mirror not set: a slip
            raise ConfigError("mirror_options are given but no mirror (mirror='s3://...')")
        if self.incremental and self.max_inflight > 1:  # a save shares the committed step before it
            raise ConfigError(
                "incremental=True needs max_inflight=1: each save shares bytes with the step "
                "before it, which must have committed first"
            )
        if self.ranks not in ("auto", "all", "local"):
            raise ConfigError(f"ranks must be 'auto', 'all' or 'local', not {self.ranks!r}")
        timeout = self.timeout_s
        # inf too is refused: a collective's timeout becomes a timedelta, which has no infinity
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ConfigError(f"timeout_s must be a positive number of seconds, not {timeout!r}")

    @property
    def retention(self) -> RetentionPolicy | None:
        """``keep`` as a policy (None: keep every step)."""
        return policy_of(self.keep)

    @classmethod
    def build(cls, config: Any = None, **options: Any) -> CheckpointConfig:
        """``config`` (or the defaults) with ``options`` replacing fields; ConfigError names a bad one."""
        if config is None:
            config = cls()
        elif not isinstance(config, cls):
            raise ConfigError(f"config must be a CheckpointConfig, not {type(config).__name__}")
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})
        if "line" in unknown:  # an earlier release's option
            raise ConfigError(
                "line= is gone: a run has one sequence of steps, and the steps newer than one "
                "restored are set aside as a run of their own (open its path; ckpt.set_aside_runs())"
            )
        if unknown:
            raise ConfigError(f"unknown Checkpointer option(s): {', '.join(unknown)}")
        built: CheckpointConfig = dataclasses.replace(config, **options) if options else config
        return built
