"""Where checkpoints live, and how one commits: a local (or NFS) directory, or an fsspec URL.

The names of a run directory are in ``_format.py``; docs/format.md describes them and the
commit protocol a :class:`LocalStore` follows.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import signal
import stat
import uuid
from abc import ABC, abstractmethod
from typing import IO, Any, Protocol

from .._errors import CheckpointError, ConfigError, describe_error
from ._faults import fault_point
from ._files import (
    LocalSink,
    LocalSource,
    Sink,
    Source,
    damage_named,
    exchange_paths,
    fsync_dir,
    write_atomic,
)
from ._format import (
    LEFTOVER_RE,
    LOCK_FILE,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    MAX_STEP,
    OLD_PREFIX,
    PROBE_PREFIX,
    SMALL_LEFTOVER_RE,
    TMP_PREFIX,
    TRASH_PREFIX,
    parse_step,
    step_name,
)
from ._manifest import Manifest, parse

__all__ = ["LocalStore", "Readable", "Store", "arm_crash", "check_step", "crash_point"]

_log = logging.getLogger("nbckpt")
_armed: str | None = None


def arm_crash(point: str | None) -> None:
    """Kill this process with SIGKILL when it reaches crash point ``point`` (None: never), for the
    reliability tests (nothing is read from the environment). Points: ``after_data`` (files
    written, no manifest), ``before_rename`` (manifest written, not renamed), ``after_swap`` and
    ``between_renames`` (a re-save's two ways of putting the new copy in place), ``during_delete``,
    ``small_write`` (a small file's replacement written, not renamed over it)."""
    global _armed
    _armed = point


def crash_point(point: str) -> None:
    if point == _armed:
        os.kill(os.getpid(), signal.SIGKILL)


def check_step(step: Any) -> int:
    """``step`` if it is an integer from 0 to :data:`MAX_STEP`, else a one-line ConfigError."""
    if isinstance(step, int) and not isinstance(step, bool) and 0 <= step <= MAX_STEP:
        return step
    # Never the huge integer in full: turning 10**5000 into text raises by itself.
    big = isinstance(step, int) and step.bit_length() > 256
    shown = f"an integer of {step.bit_length()} bits" if big else repr(step)[:100]
    bound = " up to 2**63 - 1" if isinstance(step, int) and not isinstance(step, bool) and step > 0 else ""
    raise ConfigError(f"step must be a non-negative integer{bound}, not {shown}")


class Readable(Protocol):
    """What a restore needs of a place it reads committed steps from: a store, a reader's view
    of one, or the steps another writer left in one (each says what a step holds: its
    manifest; reading its files is the same for all)."""

    url: str
    is_local: bool
    """A local or NFS directory: reading a file twice fetches it once (the page cache has it)."""

    def committed(self) -> dict[int, str]: ...
    def committed_at(self, step: int) -> str | None: ...
    def read_manifest(self, step: int, location: str) -> tuple[Manifest, bytes]: ...
    def modified(self, location: str, name: str) -> float: ...
    def read_small(self, location: str, name: str, limit: int) -> bytes: ...
    def source(self, location: str, name: str, size: int | None) -> Source: ...


class Store(ABC):
    """The storage primitives the engine needs; each subclass decides how a commit is atomic."""

    url: str
    is_local: bool = False

    @abstractmethod
    def prepare(self) -> None:
        """Create the root if needed and prove it is writable; CheckpointError if not."""

    def lock(self) -> None:  # noqa: B027 - object stores have no lock; local ones override
        """Stop a second writer on the same root (where the storage allows it)."""

    def unlock(self) -> None:  # noqa: B027
        """Release :meth:`lock`."""

    @abstractmethod
    def recover(self) -> list[str]:
        """Clean up after interrupted saves and deletes; return what was done, one phrase each."""

    @abstractmethod
    def committed(self) -> dict[int, str]:
        """Committed steps (those with a manifest) and their locations, oldest first."""

    @abstractmethod
    def committed_at(self, step: int) -> str | None:
        """The location of committed ``step``, or None: one check, not a listing. Reading a
        run's steps one by one must not list it once per step (on S3, a listing of N steps
        costs N requests)."""

    def read_manifest(self, step: int, location: str) -> tuple[Manifest, bytes]:
        """The checked manifest of committed ``step`` at ``location``, and its bytes as read."""
        where = f"{step_name(step)}/{MANIFEST}"
        with damage_named(where):
            data = self.read_small(location, MANIFEST, MAX_MANIFEST_BYTES)
        return parse(data, step, where), data

    @abstractmethod
    def names(self) -> list[str]:
        """Every entry directly under the root (steps, leftovers, set-aside runs)."""

    @abstractmethod
    def child(self, name: str) -> Store | None:
        """The store of folder ``name`` under the root (a set-aside run's), whether it exists yet
        or not; None where that entry can never be part of the run (a symlink, a file)."""

    @abstractmethod
    def modified(self, location: str, name: str) -> float:
        """When file ``name`` of ``location`` was last written (seconds since the epoch)."""

    @abstractmethod
    def write_small(self, name: str, data: bytes) -> None:
        """Write a small file under the root whole, durably, or not at all."""

    @abstractmethod
    def begin(self, step: int, nonce: str) -> str:
        """A new, empty location the files of ``step`` are written to."""

    def opened(self, step: int, nonce: str) -> str | None:
        """The location ``begin(step, nonce)`` made, where another process can already see it
        without being told (a directory every rank names alike); None where it cannot tell (an
        object store, or not made yet): it waits to hear the location from the process that began."""
        return None

    @abstractmethod
    def sink(self, location: str, name: str) -> Sink:
        """A new file ``name`` in ``location``."""

    @abstractmethod
    def source(self, location: str, name: str, size: int | None) -> Source:
        """File ``name`` of a checkpoint, which the manifest says has ``size`` bytes."""

    @abstractmethod
    def read_small(self, location: str, name: str, limit: int) -> bytes:
        """A whole small file (the manifest); CheckpointError if it is larger than ``limit``."""

    @abstractmethod
    def commit(self, location: str, step: int, manifest: bytes) -> str:
        """Write the manifest last and make ``location`` the committed ``step``; return its path."""

    @abstractmethod
    def share(self, source: str, location: str, name: str) -> None:
        """Make file ``name`` of the committed step at ``source`` file ``name`` of ``location`` too,
        without its bytes passing through this process (a hard link, a server-side copy): each
        step names it as its own, so deleting one never takes it from the other. OSError where
        the storage cannot (the caller copies instead)."""

    @abstractmethod
    def remove_small(self, name: str) -> None:
        """Remove small file ``name`` under the root, durably (nothing there: nothing to do)."""

    @abstractmethod
    def move(self, name: str, into: Store) -> None:
        """Move folder ``name`` (a committed step) into ``into``, a folder under the root, whole:
        at every moment it is committed in one place at least, and once this returns in ``into``
        only. Nothing left at ``name`` (moved before a crash): nothing to do."""

    @abstractmethod
    def discard(self, location: str) -> None:
        """Remove an uncommitted location (best effort: what stays never counts)."""

    @abstractmethod
    def delete(self, step: int) -> None:
        """Remove a committed checkpoint; it stops counting before any byte is deleted."""


class LocalStore(Store):
    """A POSIX directory (local disk, NFS, tmpfs): temp directory, fsync, rename, fsync parent."""

    is_local = True

    def __init__(self, root: str) -> None:
        self.url = os.path.abspath(os.path.expanduser(root))
        self._lock_fd: int | None = None
        self._exchange_works = True  # until renameat2(RENAME_EXCHANGE) says otherwise here

    def _path(self, name: str) -> str:
        return os.path.join(self.url, name)

    def prepare(self) -> None:
        if os.path.lexists(self.url) and not os.path.isdir(self.url):
            raise CheckpointError(f"{self.url} is not writable (it is a file, not a directory)")
        try:
            created = []
            path = self.url
            while not os.path.lexists(path):
                created.append(path)
                path = os.path.dirname(path)
            for directory in reversed(created):
                os.mkdir(directory)
                # A new directory exists for good only once its parent's entry is on disk.
                fsync_dir(os.path.dirname(directory))
            probe = LocalSink(self._path(f"{PROBE_PREFIX}{uuid.uuid4().hex[:8]}"))
            try:
                probe.write(memoryview(b"nbckpt"))
                probe.sync()
            finally:
                probe.close()
                os.unlink(probe.path)
        except OSError as exc:
            raise CheckpointError(f"{self.url} is not writable ({exc.strerror or exc})") from exc

    def lock(self) -> None:
        self._lock_fd = take_lock(self._path(LOCK_FILE), self.url)

    def unlock(self) -> None:
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            os.close(fd)  # closing releases the flock

    def names(self) -> list[str]:
        fault_point("store.names", self.url)
        try:
            return os.listdir(self.url)
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            raise CheckpointError(f"{self.url} is a file, not a directory") from None

    def child(self, name: str) -> LocalStore | None:
        path = self._path(name)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return LocalStore(path)
        except OSError:
            return None
        # A symlink is never followed out of the run: restore would read there, saves would
        # write there and clean-up would delete there (lstat: a link is not a directory).
        return LocalStore(path) if stat.S_ISDIR(mode) else None

    def recover(self) -> list[str]:
        done = []
        names = set(self.names())
        for name in sorted(names):
            match = LEFTOVER_RE.fullmatch(name)
            if match is None:
                if self._small_leftover(name):  # a crash as a small file was replaced
                    os.unlink(self._path(name))
                    done.append(name)
                continue
            kind, step = match.groups()
            if kind == "old" and step not in names and self._has_manifest(self._path(name)):
                # A re-save was cut between moving the old copy out and the new one in.
                os.rename(self._path(name), self._path(step))
                fsync_dir(self.url)
                names.add(step)
                done.append(f"{name} (put back as {step})")
            else:
                self._remove(self._path(name))
                done.append(name)
        return done

    def _small_leftover(self, name: str) -> bool:
        """Whether ``name`` is what :meth:`write_small` renames into place (a file, never a link
        nor a directory nbckpt did not make): once the lock is held, no writer is still on it."""
        try:
            return SMALL_LEFTOVER_RE.fullmatch(name) is not None and stat.S_ISREG(
                os.lstat(self._path(name)).st_mode
            )
        except OSError:
            return False

    @staticmethod
    def _has_manifest(path: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(os.path.join(path, MANIFEST)).st_mode) and not os.path.islink(path)
        except OSError:
            return False

    @staticmethod
    def _remove(path: str) -> None:
        # A symlink is removed itself, never followed (rmtree refuses links, and would
        # otherwise report success and leave it).
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
        else:
            shutil.rmtree(path)

    def committed(self) -> dict[int, str]:
        steps = {}
        for name in self.names():
            step = parse_step(name)
            if step is not None and self._has_manifest(self._path(name)):
                steps[step] = self._path(name)
        return dict(sorted(steps.items()))

    def committed_at(self, step: int) -> str | None:
        path = self._path(step_name(step))
        return path if self._has_manifest(path) else None

    def modified(self, location: str, name: str) -> float:
        return os.lstat(os.path.join(location, name)).st_mtime

    def write_small(self, name: str, data: bytes) -> None:
        temporary = self._path(f"{TMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}")  # recover() removes it

        def fill(stream: IO[bytes]) -> None:
            stream.write(data)
            crash_point("small_write")

        write_atomic(self._path(name), fill, temporary=temporary)

    def _location(self, step: int, nonce: str) -> str:
        return self._path(f"{TMP_PREFIX}{step_name(step)}-{nonce}")

    def opened(self, step: int, nonce: str) -> str | None:
        # Only begin makes it: once it is a directory here, it is the one begin made (a rank whose
        # run directory is not the one rank 0 sees finds nothing, and its files fail as before).
        location = self._location(step, nonce)
        return location if os.path.isdir(location) and not os.path.islink(location) else None

    def begin(self, step: int, nonce: str) -> str:
        location = self._location(step, nonce)
        try:
            os.mkdir(location)
        except (FileNotFoundError, NotADirectoryError):
            # The root was removed (or replaced) under us: the next save brings it back. Asked
            # only when mkdir fails, so a save costs no stat of the root.
            self.prepare()
            os.mkdir(location)
        return location

    def sink(self, location: str, name: str) -> Sink:
        fault_point("store.sink", location, name)
        return LocalSink(os.path.join(location, name))

    def source(self, location: str, name: str, size: int | None) -> Source:
        return LocalSource(os.path.join(location, name), size)

    def read_small(self, location: str, name: str, limit: int) -> bytes:
        path = os.path.join(location, name)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise CheckpointError(f"{name} is not a regular file")
            if info.st_size > limit:
                raise CheckpointError(f"{name} has {info.st_size} bytes, more than a manifest may ({limit})")
            # Its size and one byte more, never ``limit``: pread makes a buffer of what it is asked.
            data = os.pread(fd, info.st_size + 1, 0)
        finally:
            os.close(fd)
        if len(data) > info.st_size:
            raise CheckpointError(f"{name} grew while it was read")
        return data

    def commit(self, location: str, step: int, manifest: bytes) -> str:
        sink = LocalSink(os.path.join(location, MANIFEST))  # one write: no block hashes to keep
        try:
            sink.write(memoryview(manifest))
            sink.sync()
        finally:
            sink.close()
        fsync_dir(location)
        crash_point("before_rename")
        final = self._path(step_name(step))
        old = self._path(f"{OLD_PREFIX}{step_name(step)}-{uuid.uuid4().hex[:8]}")
        replaced = os.path.lexists(final)
        if replaced:
            replaced = self._swap_in(location, final, old)
        else:
            os.rename(location, final)
        try:
            fsync_dir(self.url)
        except OSError:
            self._withdraw(location, final, old if replaced else None)
            raise
        if replaced:
            crash_point("after_swap")
            self._remove(old)
        return final

    def _swap_in(self, location: str, final: str, old: str) -> bool:
        """Make ``location`` the step at ``final``; the previous copy ends up at ``old`` (False:
        nothing was left of it, as when the file system renamed instead of exchanging)."""
        if self._exchange_works and exchange_paths(location, final):
            if not os.path.lexists(location):  # the flag was ignored: an empty copy was replaced
                return False
            os.rename(location, old)  # ``location`` now holds the previous copy
            return True
        self._exchange_works = False  # once per store: each try costs a round trip on NFS
        os.rename(final, old)  # from here the next open puts ``old`` back if we stop
        crash_point("between_renames")
        try:
            os.rename(location, final)
        except OSError:
            os.rename(old, final)
            raise
        return True

    def _withdraw(self, location: str, final: str, old: str | None) -> None:
        """Undo a commit whose parent fsync failed, so the caller's "failed" matches the disk."""
        try:
            os.rename(final, location)
            if old is not None:
                os.rename(old, final)
        except OSError as exc:  # nothing more can be done here; the next open sorts it out
            _log.warning("nbckpt: could not withdraw %s after a failed fsync: %s", final, describe_error(exc))

    def share(self, source: str, location: str, name: str) -> None:
        # A hard link: one inode, a name in each step; the file system counts the names, so the
        # bytes stay until the last step holding them is deleted. Its directory entry is made
        # durable with the new step's (commit fsyncs the directory); its bytes already are.
        fault_point("store.share", source, location, name)
        os.link(os.path.join(source, name), os.path.join(location, name), follow_symlinks=False)

    def remove_small(self, name: str) -> None:
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            return
        fsync_dir(self.url)

    def move(self, name: str, into: Store) -> None:
        # One rename: the step is here or there, never both nor neither; the hard links an
        # incremental step shares with others move with their names, so every step stays whole.
        assert isinstance(into, LocalStore)  # a local run's folders are local
        if not os.path.lexists(self._path(name)):
            return
        os.rename(self._path(name), into._path(name))
        fsync_dir(into.url)
        fsync_dir(self.url)

    def discard(self, location: str) -> None:
        try:
            self._remove(location)
        except OSError as exc:
            _log.warning("nbckpt: could not remove %s: %s", location, describe_error(exc))

    def delete(self, step: int) -> None:
        trash = self._path(f"{TRASH_PREFIX}{step_name(step)}-{uuid.uuid4().hex[:8]}")
        os.rename(self._path(step_name(step)), trash)
        fsync_dir(self.url)
        crash_point("during_delete")
        self._remove(trash)


def take_lock(path: str, url: str) -> int:
    """``flock`` the lock file ``path`` of the run at ``url`` and write our pid in it; its
    descriptor (closing it releases the lock). Whatever else sits there is one line's error."""
    # O_NOFOLLOW: a symlink planted there is never followed (nor its target truncated);
    # O_NONBLOCK: a FIFO there never blocks the open.
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        raise _not_a_lock(path, exc) from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _not_a_lock(path, None)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise CheckpointError(f"cannot lock {path} ({exc.strerror})") from exc
        if holder == str(os.getpid()):
            raise CheckpointError(
                f"{url} is in use by another Checkpointer in this process; close it "
                "(ckpt.close()) or call nbckpt.close_all()"
            ) from exc
        raise CheckpointError(
            f"{url} is in use by another Checkpointer (pid {holder}); "
            "use a different directory or close the other one first"
        ) from exc
    except BaseException:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    except OSError as exc:
        os.close(fd)
        raise CheckpointError(f"cannot lock {path} ({describe_error(exc)})") from exc
    return fd


def _not_a_lock(path: str, error: OSError | None) -> CheckpointError:
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        mode = 0
    kinds = (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
    )
    kind = next((name for test, name in kinds if test(mode)), None)
    if kind is None:
        reason = describe_error(error) if error is not None else "not a regular file"
        return CheckpointError(f"cannot lock {path} ({reason})")
    return CheckpointError(f"cannot lock {path}: it is {kind}, not nbckpt's lock file; remove it")
