"""Every rank of a group must see the root rank 0 opens (the run's directory, the mirror): rank 0
makes the step's location there and each rank writes its files into it. A root the ranks do not
share (each host's own ``/tmp``, a path that differs per rank) used to fail only at the first
save, with "file not found" or worse. It is refused at open instead, inside the open's one
exchange, at no cost to a save:

- rank 0 claims the root (prepares and locks it) and writes a fresh nonce in :data:`RANKS_PROBE`
  there, durably, *before* it checks in for the exchange;
- every other rank reads the probe back only once every rank has checked in, so after rank 0
  wrote and closed it: NFS's close-to-open consistency makes a file one client wrote and closed
  visible to another client that opens it afterwards (and an object store is read-after-write);
- the exchange gathers what each rank read, and every rank tells the same ConfigError from it;
  rank 0 removes the probe once the exchange is over (each rank has read it) and, on a refusal,
  gives back what it claimed.

On an object store (every rank names the same bucket by construction, unless the URL differs per
rank) the same check runs through the store: one small object written, read, removed.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from contextlib import suppress
from functools import partial
from typing import Any, TypeVar, cast

from .._errors import ConfigError
from ._format import RANKS_PROBE
from ._ranks import Group, Tag
from ._store import Store

__all__ = ["open_on_rank0"]

T = TypeVar("T")


def open_on_rank0(
    group: Group,
    tag: Tag,
    store: Store,
    claim: Callable[[], None] | None,
    rest: Callable[[], T],
    *,
    undo: Callable[[], None],
    what: str,
) -> T:
    """``claim`` then ``rest`` on rank 0 (``group.from_rank0``'s exchange ``tag``: every rank
    gets ``rest``'s result or error); with several ranks, every rank must see the probe rank 0
    wrote in ``store`` in between, or every rank raises a ConfigError naming the ranks that do
    not see ``what`` (rank 0 calls ``undo`` first: what ``claim`` holds, it gives back).
    ``claim`` None on rank 0 (it reads only): nothing claimed, no probe, nothing checked. The
    other ranks' ``claim`` is not used: whether they are checked is rank 0's to say (rank 0 may
    write and the others only read)."""
    if group.world_size == 1:
        # as many frames above ``rest`` as on rank 0 of several (its warnings point at the caller)
        return group.from_rank0(tag, partial(_both, claim, rest))
    if group.rank == 0:
        gathered = _rank0(group, tag, store, claim, rest, undo)
    else:
        gathered = group.exchange(tag, lambda: _read_back(store), arrive_first=True)
    url, nonce, result = gathered[0]
    blind = {rank: seen[0] for rank, seen in enumerate(gathered) if rank and nonce and seen[1] != nonce}
    if blind:
        if group.rank == 0:
            undo()
        raise ConfigError(_refusal(what, url, blind))
    return cast(T, result)


def _both(claim: Callable[[], None] | None, rest: Callable[[], T]) -> T:
    if claim is not None:
        claim()
    return rest()


def _rank0(
    group: Group,
    tag: Tag,
    store: Store,
    claim: Callable[[], None] | None,
    rest: Callable[[], T],
    undo: Callable[[], None],
) -> list[Any]:
    """Rank 0's side: claim and probe before checking in, ``rest`` after; the probe goes once
    the exchange is over, whatever its outcome (the other ranks read it before it ended).
    Without ``claim`` (a reader), ``rest`` alone and no probe: its nonce None."""
    if claim is None:
        return group.exchange(tag, lambda: (store.url, None, rest()), arrive_first=True)
    nonce = uuid.uuid4().hex
    failure: BaseException | None = None
    try:
        claim()
        try:
            store.write_small(RANKS_PROBE, nonce.encode())
        except BaseException:
            undo()
            raise
    except BaseException as exc:  # told to every rank by the exchange, as from_rank0 would
        failure = exc

    def part() -> tuple[str, str, T]:
        if failure is not None:
            raise failure
        return store.url, nonce, rest()

    try:
        return group.exchange(tag, part, arrive_first=True)
    except BaseException:
        if failure is None:
            undo()  # another rank failed (or rest did): rank 0 keeps nothing it claimed
        raise
    finally:
        if failure is None:
            with suppress(Exception):  # left behind, it never counts; the next open replaces it
                store.remove_small(RANKS_PROBE)


def _read_back(store: Store) -> tuple[str, str | None]:
    """This rank's root and the probe it finds there (None: none, or unreadable)."""
    try:
        return store.url, store.read_small(store.url, RANKS_PROBE, 256).decode("ascii", "replace")
    except Exception:  # not there, not a directory, not reachable: it does not see rank 0's root
        return store.url, None


def _refusal(what: str, url: str, blind: dict[int, str]) -> str:
    ranks = ", ".join(map(str, blind))
    elsewhere = [f"rank {rank} opened {there}" for rank, there in blind.items() if there != url]
    where = f" ({'; '.join(elsewhere)})" if elsewhere else ""
    return (
        f"rank(s) {ranks} do not see the {what} rank 0 opened, {url}{where}: every rank must open "
        "the same one, on storage they all share (a network file system or an object store, not "
        "each host's own disk)"
    )
