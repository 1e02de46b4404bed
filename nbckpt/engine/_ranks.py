"""Agreement across ranks: every collective is an all-gather of ``(tag, value, error)``, the tag
naming the operation and step, pickled into one fixed-size row per rank (a second all-gather only
when a rank's does not fit). An exception on any rank is an error on all
(a ConfigError stays one), tags that differ are "ranks are out of step" on all, and a rank that
died fails the others within ``timeout_s``. Each thread that talks to other ranks (the caller's,
the background writer's) has its own process group, so their collectives never interleave.
Before each of the caller's collectives, and before the background's agreement on each save
(``RankInfo.agreement``: the background's group, checking in), the ranks check in through the
default group's store, so that a save called on some ranks only (nanoGPT's ``if master_process:``
around it, while the others wait in DDP's all-reduce) is a ConfigError within
:data:`ARRIVAL_TIMEOUT_S`, not a hang until the process group's timeout. Each of the two check-ins
has a connection to the store of its own: a store client serves one request at a time, so a
thread waiting for the other ranks on a shared one kept the other thread from checking in, and
two ranks whose threads waited in opposite order held each other up until the deadline.
A Checkpointer closed on every rank gives its groups back (:meth:`RankInfo.leave`): the ranks
check in to the close (after their threads are done with the groups), and only once every rank
has does each destroy them, so none is still in its last collective on a group another destroys.
Otherwise (a close on some ranks only, a rank gone, a Checkpointer dropped unclosed, a failed
open) they are only let go of: torch keeps them, and their connections to every other rank, until
the default group is destroyed (about 4 sockets a rank per Checkpointer on 2 ranks).
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import struct
import threading
from collections.abc import Callable, Iterable
from contextlib import suppress
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from .._errors import CheckpointError, ConfigError, NbckptError, describe_error
from ._faults import fault_point
from ._torch_compat import default_store, own_connection

__all__ = ["Group", "RankInfo", "join", "pack_row", "unpack_rows"]

_log = logging.getLogger("nbckpt")
T = TypeVar("T")
Tag = tuple[Any, ...]
_opened = itertools.count()
#: How long the ranks wait for each other to create a Checkpointer before saying why not.
JOIN_TIMEOUT_S = 60.0
#: How long a rank waits for the others to reach the same Checkpointer call. Ranks of a training
#: job come to a save from the same step (their gradients' all-reduce keeps them together), so a
#: rank still missing after this long is in something else.
ARRIVAL_TIMEOUT_S = 30.0
#: How long a closing rank waits for the others to close the same Checkpointer before it leaves
#: its groups to torch: ranks close together (the same cell, the end of the same script), so one
#: missing after this long closes later or never; a close on one rank alone costs this long.
CLOSE_TIMEOUT_S = 5.0
#: Bytes of each rank's row in an exchange's all-gather to begin with: a save's exchanges carry a
#: few KiB (its files' checksums, the plain values' tree, RNG states). ``all_gather_object`` sends
#: the sizes first and then the pickles, two collectives each a round trip through every rank
#: (11.8 ms against 5.1 ms for one all-gather of 4 KiB, 4 gloo ranks on 2 loaded cores); a save
#: makes two or three of them as it persists, between the copy and the commit (``_saver``).
SLOT_BYTES = 16 * 1024
#: The largest a row grows to after a larger exchange (beyond it, the larger ones take two).
SLOT_MAX_BYTES = 1 << 20
_LENGTH = struct.Struct("<q")  # a row starts with its pickle's length; -length: it did not fit


class Arrivals:
    """The ranks' check-in before each collective of one group, in the default group's store:
    each rank sets its key for the collective and waits, within a deadline, for everyone's."""

    def __init__(self, store: Any, prefix: str, rank: int, world_size: int, timeout_s: float) -> None:
        self._store, self._prefix, self.rank, self._world = store, prefix, rank, world_size
        self._timeout = timeout_s
        self.count = 0

    def release(self) -> None:
        """Let go of the store connection, though a traceback may keep this object alive."""
        self._store = None

    def _deadline(self, tag: Tag) -> float:
        """How long ``tag``'s check-in waits for the other ranks. The open's waits as long as the
        group's collectives: rank 0 may first wait there for a Checkpointer of its process
        dropped unclosed to finish its uploads (``_shutdown.wait_released``), and a rank that never
        opens was found at the join already (with the check-in's deadline, the other ranks gave
        up on rank 0, and rank 0 then on them: the run opened nowhere)."""
        return self._timeout if tag == ("open",) else min(ARRIVAL_TIMEOUT_S, self._timeout)

    def wait(self, tag: Tag) -> None:
        """Return once every rank has reached this collective; ConfigError naming the ranks
        missing after the deadline."""
        self.count += 1
        here = f"{self._prefix}/{self.count}"
        self._store.set(f"{here}/{self.rank}", "")
        if self.count > 2:  # every rank has passed the collective after that one: never read again
            with suppress(Exception):  # a store that cannot delete only keeps a few bytes more
                self._store.delete_key(f"{self._prefix}/{self.count - 2}/{self.rank}")
        keys = [f"{here}/{r}" for r in range(self._world)]
        fault_point("ranks.arrive", tag)
        deadline = self._deadline(tag)
        try:
            self._store.wait(keys, timedelta(seconds=deadline))
        except Exception as exc:
            missing = [str(r) for r, key in enumerate(keys) if not self._store.check([key])]
            if not missing:
                return  # the last came as the deadline passed
            # Withdrawn, and not counted: the ranks that never came check in at this count for
            # their next collective, and this rank's next one meets them there. Counted, every
            # later collective found the others a check-in behind: refused, or one of them went
            # on alone into its all-gather (a refused rank-0-only delete broke the next saves).
            with suppress(Exception):
                self._store.delete_key(f"{here}/{self.rank}")
            self.count -= 1
            raise ConfigError(
                f"rank {self.rank} is in {_what(tag)}, rank(s) {', '.join(missing)} did not come to it "
                f"within {deadline:.0f} s: every rank must make the same "
                "Checkpointer calls, or pass ranks='local' to save on one rank alone (as under "
                "nanoGPT's 'if master_process:')"
            ) from exc


class Group:
    """The collectives of one thread; ``pg`` is None for a single process (no communication)."""

    def __init__(self, pg: Any, rank: int, world_size: int, arrivals: Arrivals | None = None) -> None:
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        self._arrivals = arrivals
        self._slot = SLOT_BYTES  # the same on every rank: each sees every rank's sizes
        self._released = False

    def release(self) -> None:
        """Let go of the process group and the store connection: their sockets close once no
        collective holds them. Every later exchange is refused (``pg`` None would be one process)."""
        if self._arrivals is not None:
            self._arrivals.release()
        if self.pg is not None:
            self.pg, self._arrivals, self._released = None, None, True

    def exchange(self, tag: Tag, run: Callable[[], T], *, arrive_first: bool = False) -> list[T]:
        """Run ``run`` here, give every rank every rank's result; an error anywhere is raised on
        all: the exception itself where it happened, a CheckpointError (ConfigError for a user
        mistake) naming the rank elsewhere. With ``arrive_first`` every rank must have come to
        ``tag`` before ``run`` starts (for a ``run`` that changes something); otherwise ``run``
        goes first, overlapping the wait for the last rank to arrive."""
        if self._released:
            raise CheckpointError(f"rank {self.rank}: {_what(tag)} after the Checkpointer was closed")
        arrivals = self._arrivals if self.pg is not None else None
        if arrivals is not None and arrive_first:
            arrivals.wait(tag)
        value: Any = None
        error: BaseException | None = None
        try:
            value = run()
        except BaseException as exc:
            if self.pg is None:
                raise
            error = exc
        if self.pg is None:
            return [value]
        if arrivals is not None and not arrive_first:
            arrivals.wait(tag)
        sent = (tag, None if error is not None else value, _summary(error))
        try:
            gathered = self._gather(pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as exc:
            raise CheckpointError(
                f"lost contact with the other ranks during {_what(tag)}: {describe_error(exc)}"
            ) from (error or exc)
        if error is not None:
            raise error
        _check_tags(tag, gathered)
        for rank, (_, _, summary) in enumerate(gathered):
            if summary is not None:
                kind, message = summary
                cls = ConfigError if kind == "config" else CheckpointError
                raise cls(f"rank {rank}: {message}")
        return [value for _, value, _ in gathered]

    def _gather(self, payload: bytes) -> list[Any]:
        """Every rank's ``payload``, unpickled (the ranks of this job pickled them, as
        ``all_gather_object`` unpickles them): one all-gather of a row each where every one fits,
        else a second at the largest size, which the rows of the next exchanges then take."""
        rows, needed = self._all_gather(payload, self._slot)
        if needed:
            slot = _LENGTH.size + needed
            rows, _ = self._all_gather(payload, slot)
            self._slot = max(self._slot, min(SLOT_MAX_BYTES, 1 << (slot - 1).bit_length()))
        return [pickle.loads(row) for row in rows]  # written by this job's ranks

    def _all_gather(self, payload: bytes, slot: int) -> tuple[list[bytes], int]:
        """Every rank's row of ``slot`` bytes; their payloads, or the largest that did not fit."""
        mine = pack_row(payload, slot)
        rows = [torch.empty(slot, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(rows, mine, group=self.pg)
        return unpack_rows(row.numpy().tobytes() for row in rows)

    def from_rank0(self, tag: Tag, run: Callable[[], T]) -> T:
        """``run`` on rank 0 only, once every rank has come to it (it deletes, moves or creates:
        called on rank 0 alone, it is refused before it changes anything); every rank gets its
        result (or its error)."""
        results: list[Any] = self.exchange(tag, run if self.rank == 0 else lambda: None, arrive_first=True)
        return cast(T, results[0])


def pack_row(payload: bytes, slot: int) -> torch.Tensor:
    """A row of ``slot`` bytes: ``payload``'s length and ``payload``, or minus its length alone
    where it does not fit."""
    row = bytearray(slot)
    fits = _LENGTH.size + len(payload) <= slot
    _LENGTH.pack_into(row, 0, len(payload) if fits else -len(payload))
    if fits:
        row[_LENGTH.size : _LENGTH.size + len(payload)] = payload
    return torch.frombuffer(row, dtype=torch.uint8)


def unpack_rows(rows: Iterable[bytes]) -> tuple[list[bytes], int]:
    """The payloads of ``rows`` (:func:`pack_row`'s) and 0, or ``[]`` and the largest length of
    those that did not fit."""
    payloads, needed = [], 0
    for row in rows:
        (length,) = _LENGTH.unpack_from(row)
        if length < 0:
            needed = max(needed, -length)
        else:
            payloads.append(row[_LENGTH.size : _LENGTH.size + length])
    return ([], needed) if needed else (payloads, 0)


def _summary(error: BaseException | None) -> tuple[str, str] | None:
    if error is None:
        return None
    if isinstance(error, ConfigError):
        return "config", str(error)
    if isinstance(error, NbckptError):
        return "checkpoint", str(error)
    if isinstance(error, KeyboardInterrupt):
        return "checkpoint", "interrupted (KeyboardInterrupt)"
    return "checkpoint", describe_error(error)


#: The operations of a save, whose tags are (operation, step, the Checkpointer's save number);
#: a restore's are (operation, step, attempt).
_SAVE_PARTS = frozenset({"save", "plan", "staged", "begin", "write", "commit"})


def _what(tag: Tag, numbered: bool = False) -> str:
    """What ``tag`` is doing, for a message; ``numbered``: with its save number (or attempt)."""
    operation, *rest = tag
    if not (rest and isinstance(rest[0], int)):
        return str(operation)
    if numbered and len(rest) > 1:
        number = "save number" if operation in _SAVE_PARTS else "attempt"
        return f"{operation} of step {rest[0]} ({number} {rest[1]})"
    return f"{operation} of step {rest[0]}"


def _check_tags(tag: Tag, gathered: list[Any]) -> None:
    tags = [entry[0] if isinstance(entry, tuple) and len(entry) == 3 else None for entry in gathered]
    if any(t != tag for t in tags):
        # Steps alike, numbers not (a rank made a save the others did not): the numbers tell them apart.
        alike = len({_what(t) for t in tags if isinstance(t, tuple)}) == 1
        where = ", ".join(
            f"rank {rank} is in {_what(t, alike) if isinstance(t, tuple) else 'something else'}"
            for rank, t in enumerate(tags)
        )
        raise CheckpointError(
            f"ranks are out of step ({where}); every rank must save and restore the same steps "
            "in the same order"
        )


class RankInfo:
    """Where this process stands: its rank, the world size, and a group per talking thread;
    ``agreement`` is the background's group with a check-in before each collective, for the
    first collective of each save (the others follow a save every rank has entered)."""

    def __init__(
        self,
        caller: Group,
        background: Group,
        agreement: Group | None = None,
        closing: Arrivals | None = None,
    ) -> None:
        self.caller = caller
        self.background = background
        self.agreement = agreement or background
        self.rank = caller.rank
        self.world_size = caller.world_size
        self._closing = closing

    def stop(self, wait: bool) -> None:
        """Let go of the groups :func:`join` made and their store connections, once this
        Checkpointer's threads are done with them (dropped, or a failed open: no rank waits for
        the others there); ``wait`` is :func:`._shutdown.release`'s. Later use of them is refused.
        Torch's own entry for each group stays until the default group is destroyed: another rank
        may still be in its last collective on it (destroying it under that rank's collective is
        what :meth:`leave` avoids)."""
        if self._closing is not None:
            self._closing.release()
        for group in (self.caller, self.background, self.agreement):
            group.release()

    def leave(self) -> None:
        """At close, once this Checkpointer's threads have ended: check in to the close, and
        destroy the groups (each rank its own: local for a subgroup, no collective) only where
        every rank has come to it within :data:`CLOSE_TIMEOUT_S`, none of them in a collective on
        them any more. Otherwise, as :meth:`stop`: never a hang, never an error."""
        made = {id(group.pg): group.pg for group in (self.caller, self.background) if group.pg is not None}
        try:
            together = bool(made) and self._closing is not None and _all_closing(self._closing)
        finally:  # let go of them even when interrupted
            self.stop(True)
        for pg in made.values() if together else ():
            _destroy(pg)


def join(mode: str, timeout_s: float) -> RankInfo:
    """The ranks a Checkpointer works with: all ranks of the default group, or this one alone.
    They first meet in the default group's store, so a rank that never creates its Checkpointer
    is a ConfigError after :data:`JOIN_TIMEOUT_S`, not a hang."""
    together = mode == "all" or (
        mode == "auto" and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    )
    if not together:
        return RankInfo(Group(None, 0, 1), Group(None, 0, 1))
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("ranks='all' needs torch.distributed initialized (torchrun); use ranks='local'")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    store = default_store()
    # Each thread checks in on a connection of its own (the module's docstring says why). Where
    # the store cannot make one, the caller's thread uses the default one (no other nbckpt thread
    # waits there) and the background's agreement checks in nowhere (the group's timeout applies).
    caller, background = (None if store is None else own_connection(store) for _ in range(2))
    caller = store if caller is None else caller
    opened = _meet(caller, rank, world_size)
    timeout = timedelta(seconds=timeout_s)
    groups: list[Any] = []
    try:
        with _REGISTRY:
            groups.extend(dist.new_group(backend="gloo", timeout=timeout) for _ in range(2))
    except Exception as exc:
        for made in groups:  # the first, where the second failed
            _destroy(made)
        raise CheckpointError(
            f"could not set up the ranks' checkpoint groups: {describe_error(exc)}"
        ) from exc
    arrivals, agreed, closing = (
        None
        if connection is None
        else Arrivals(connection, f"nbckpt/{where}/{opened}", rank, world_size, wait)
        for connection, where, wait in (
            (caller, "in", timeout_s),
            (background, "agree", timeout_s),
            (caller, "close", CLOSE_TIMEOUT_S),  # the caller's thread closes, its threads ended
        )
    )
    return RankInfo(
        Group(groups[0], rank, world_size, arrivals),
        Group(groups[1], rank, world_size),
        Group(groups[1], rank, world_size, agreed),
        closing,
    )


def _all_closing(closing: Arrivals) -> bool:
    """Whether every rank came to this Checkpointer's close (:meth:`RankInfo.leave`)."""
    if not dist.is_initialized():  # the default group destroyed first: torch shut every group down
        return False
    try:
        closing.wait(("close",))
    except Exception as exc:  # missing ranks (ConfigError), or the store gone with a rank
        why = describe_error(exc)
        _log.info("nbckpt: rank %d leaves its checkpoint groups to torch: %s", closing.rank, why)
        return False
    return True


#: Held while nbckpt adds groups to torch's registry or drops them: a Checkpointer closed on one
#: thread may give its groups back while another opens on another, and torch updates its
#: registry's several tables without a lock.
_REGISTRY = threading.Lock()


def _destroy(pg: Any) -> None:
    """Drop torch's entry for a group :func:`join` made (this rank only)."""
    # Gone already where the default group was destroyed meanwhile (on another thread): torch
    # shut every group down then.
    with _REGISTRY, suppress(Exception):
        dist.destroy_process_group(pg)


def _meet(store: Any, rank: int, world_size: int) -> int:
    """The number of this Checkpointer among those the ranks opened (the same on every rank)."""
    opened = next(_opened)
    if store is None:
        return opened
    prefix = f"nbckpt/open/{opened}"
    store.set(f"{prefix}/{rank}", str(os.getpid()))
    try:
        store.wait([f"{prefix}/{r}" for r in range(world_size)], timedelta(seconds=JOIN_TIMEOUT_S))
    except Exception as exc:
        arrived = [r for r in range(world_size) if store.check([f"{prefix}/{r}"])]
        raise ConfigError(
            f"only rank(s) {', '.join(map(str, arrived))} of {world_size} created this Checkpointer "
            f"within {JOIN_TIMEOUT_S:.0f} s; every rank must create it, or pass ranks='local' when "
            "one rank saves alone (as Lightning and nanoGPT do)"
        ) from exc
    return opened
