"""The one-writer lock of a local run directory: ``flock`` on ``.nbckpt.lock``, which holds the pid.

Whatever sits at that path is handled in one line: a second writer ("in use", naming the pid or
saying that it is this process), and something that is not the lock file at all (a symlink,
which is never followed; a directory; a FIFO, which never blocks the open). A lock that was not
taken leaves no descriptor open.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from .._errors import CheckpointError, describe_error

__all__ = ["take_lock"]


def take_lock(path: str, url: str) -> int:
    """Lock ``path`` (the lock file of the run at ``url``) for this process; its descriptor.

    Closing the descriptor releases the lock.
    """
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
    """The lock file is something else (a symlink, a directory, a FIFO): one line saying what."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        mode = 0
    kinds = ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))
    kind = next((name for test, name in kinds if test(mode)), None)
    if kind is None:
        reason = describe_error(error) if error is not None else "not a regular file"
        return CheckpointError(f"cannot lock {path} ({reason})")
    return CheckpointError(f"cannot lock {path}: it is {kind}, not nbckpt's lock file; remove it")
