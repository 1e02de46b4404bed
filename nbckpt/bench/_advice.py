"""The probe's advice: plain words, each item tied to a measured or mounted value of the target."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._util import GB, MIB, format_bytes

if TYPE_CHECKING:  # the probe imports this module to advise on its result
    from ._probe import ProbeResult

__all__ = ["storage_advice"]


def _streams(count: int) -> str:
    return "1 stream" if count == 1 else f"{count} streams"


def storage_advice(result: ProbeResult) -> list[str]:
    """Plain-words advice, each item tied to a measured or mounted value of ``result``."""
    advice: list[str] = []
    best, first = result.best(), (result.runs[0] if result.runs else None)
    if best is not None and first is not None:
        if best.streams > first.streams and best.write_gbs > 1.25 * first.write_gbs:
            advice.append(
                f"{_streams(first.streams)} wrote {first.write_gbs:.2f} GB/s, {best.streams} streams "
                f"{best.write_gbs:.2f} GB/s: use Checkpointer(..., writer_threads={best.streams}) "
                "so one rank writes several files at once."
            )
        elif len(result.runs) > 1:
            advice.append(
                f"{_streams(first.streams)} already reached {first.write_gbs:.2f} GB/s (best "
                f"{best.write_gbs:.2f} GB/s with {best.streams}): more writer threads do not pay off "
                "here; keep writer_threads at 1 or 2."
            )
    if result.checkpoint_bytes and best is not None and best.write_gbs > 0:
        seconds = result.checkpoint_bytes / (best.write_gbs * GB)
        advice.append(
            f"At {best.write_gbs:.2f} GB/s a {format_bytes(result.checkpoint_bytes)} checkpoint takes "
            f"about {seconds:.3g} s to persist: checkpoint less often than that, or saves queue up "
            "(async mode hides the write, not the bandwidth)."
        )
    if result.checkpoint_bytes and result.free_bytes is not None:
        if result.free_bytes < result.checkpoint_bytes:
            advice.append(
                f"Free space {format_bytes(result.free_bytes)} is less than one checkpoint "
                f"({format_bytes(result.checkpoint_bytes)}): saves will fail with ENOSPC."
            )
        elif result.free_bytes < 2 * result.checkpoint_bytes:
            advice.append(
                f"Free space {format_bytes(result.free_bytes)} is less than twice the checkpoint "
                f"({format_bytes(result.checkpoint_bytes)}): a new checkpoint is written before the "
                "old one is deleted, so keep room for keep+1 checkpoints."
            )
    advice.extend(_mount_advice(result))
    if result.cache_dropped is False and result.kind != "memory":
        advice.append(
            "The page cache could not be dropped after writing, so read figures may be memory "
            "speed, not storage speed."
        )
    if result.fsync_ms is not None and result.fsync_ms > 10:
        advice.append(
            f"fsync takes {result.fsync_ms:.1f} ms (median): every checkpoint file and directory is "
            "fsynced, so use mode='async' to keep this off the training loop."
        )
    if result.create_per_s is not None and result.create_per_s < 200:
        what = "small-object PUTs" if result.kind == "object" else "file creates"
        advice.append(
            f"Only {result.create_per_s:,.0f} {what}/s: each checkpoint costs a few of them "
            "(data files, metadata, manifest) plus the retention deletes, so keep the number of "
            "files per checkpoint small (writer_threads of 8 or less) and checkpoint no more often "
            "than the measured bandwidth allows."
        )
    if not advice:
        advice.append("Nothing to change: the measured figures and mount options look fine.")
    return advice


def _mount_advice(result: ProbeResult) -> list[str]:
    advice = []
    if result.kind == "memory":
        advice.append(
            f"{result.mount_point} is {result.fstype}: it lives in RAM (and counts against it) and "
            "is lost at reboot or power loss. Good for experiments; not for protecting a run."
        )
    if result.fstype == "overlay":
        advice.append(
            "This is a container's overlay filesystem: checkpoints vanish with the container. "
            "Mount a volume (or the shared storage) for the checkpoint directory."
        )
    if result.fstype.startswith("fuse."):
        advice.append(
            f"{result.fstype} is a FUSE filesystem: fsync and rename guarantees depend on its driver."
            + (" For object storage use the s3:// URL directly." if result.kind == "network" else "")
        )
    if result.kind == "object":
        advice.append(
            "Object store: no rename, so nbckpt commits by writing manifest.json after all data. "
            "A dead endpoint fails a save at once, a hung one only after read_timeout x attempts "
            "(storage_options config_kwargs; see docs/storage.md)."
        )
    mount = result.mount
    if not mount.is_nfs:
        return advice
    options = mount.options
    nconnect = mount.option_int("nconnect")
    if nconnect is None or nconnect < 2:
        advice.append(
            "NFS mount without nconnect: all traffic goes over one TCP connection, often the limit "
            "of a single client. Remount with nconnect=8 or 16 (Linux 5.3 or later): the client "
            "spreads its RPCs over the connections (Pure measured about 10 Gbps with one and 70 "
            "Gbps with nconnect=16 reading from a FlashBlade; see docs/storage.md)."
        )
    for key in ("rsize", "wsize"):
        size = mount.option_int(key)
        if size is not None and size < MIB:
            advice.append(f"{key}={size} is below 1 MiB: mount with {key}=1048576 for large checkpoint I/O.")
    if "soft" in options:
        advice.append(
            "soft mount: a slow server makes writes fail with EIO after retrans timeouts; use hard "
            "(the default) so a server hiccup delays a save instead of failing it."
        )
    if (options.get("proto") or "").startswith("udp"):
        advice.append("proto=udp: use TCP (proto=tcp) for large writes.")
    if options.get("vers") in ("4", "4.0"):
        advice.append(
            f"vers={options.get('vers')}: NFS v4.0 has no sessions; use v4.1 or v3 where the server "
            "offers them (FlashBlade serves both)."
        )
    return advice
