"""The storage probe: mount lookup in /proc/self/mountinfo, advice rules, real probes of tmpfs and disk."""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from nbckpt import ConfigError
from nbckpt.bench import Floors, ProbeResult, measure_write, mount_info, probe
from nbckpt.bench._measure import StreamRun, concurrent_write
from nbckpt.bench._probe import MountInfo, _advice
from nbckpt.cli import main as cli
from nbckpt.engine._internal import cached_fraction

# /proc/self/mountinfo lines: id parent dev root mount-point options [optional] - type source super-options
NFS3 = (
    "352 27 0:52 / /mnt/fb rw,relatime shared:180 - nfs fb01-data.example.com:/ckpt rw,vers=3,"
    "rsize=1048576,wsize=1048576,namlen=255,hard,nconnect=8,proto=tcp,timeo=600,retrans=2,sec=sys,"
    "mountaddr=10.0.0.5,mountvers=3,mountport=2049,mountproto=tcp,local_lock=none,addr=10.0.0.5"
)
NFS4 = (
    "353 27 0:53 / /mnt/fb4 rw,noatime - nfs4 10.0.0.5:/ckpt rw,vers=4.1,rsize=65536,wsize=65536,"
    "namlen=255,soft,proto=tcp,timeo=600,retrans=2,sec=sys,clientaddr=10.0.0.9,local_lock=none,addr=10.0.0.5"
)
SSHFS = (
    "360 30 0:60 / /home/alice/remote\\040data rw,nosuid,nodev,relatime - fuse.sshfs "
    "alice@gpu-box:/data rw,user_id=1000,group_id=1000"
)
S3FS = "361 27 0:61 / /mnt/bucket rw,nosuid,nodev - fuse.s3fs s3fs rw,user_id=0,group_id=0,allow_other"
EXT4 = "27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw,errors=remount-ro"
XFS = (
    "90 27 9:0 / /scratch rw,noatime shared:40 - xfs /dev/md0 rw,attr2,inode64,logbufs=8,logbsize=32k,"
    "sunit=1024,swidth=4096,noquota"
)
TMPFS = "25 24 0:23 / /dev/shm rw,nosuid,nodev - tmpfs tmpfs rw,size=65536k,inode64"
OVERLAY = (
    "27 1 0:40 / / rw,relatime - overlay overlay rw,lowerdir=/var/lib/docker/overlay2/l/ABC:"
    "/var/lib/docker/overlay2/l/DEF,upperdir=/var/lib/docker/overlay2/123/diff,"
    "workdir=/var/lib/docker/overlay2/123/work"
)


def mount_of(line: str) -> MountInfo:
    """The mount a one-line mountinfo gives its own mount point."""
    point = line.split()[4].replace("\\040", " ")
    return mount_info(point, mountinfo=line)


def test_nfs3_mount_with_its_superblock_options() -> None:
    mount = mount_of(NFS3)
    assert mount.source == "fb01-data.example.com:/ckpt"
    assert (mount.mount_point, mount.fstype, mount.kind) == ("/mnt/fb", "nfs", "network")
    assert mount.options["nconnect"] == "8" and mount.options["wsize"] == "1048576"
    assert mount.options["hard"] is None and mount.options["relatime"] is None  # both kinds of options


def test_nfs4_mount() -> None:
    mount = mount_of(NFS4)
    assert mount.fstype == "nfs4" and mount.kind == "network"
    assert mount.options["vers"] == "4.1" and "soft" in mount.options and "nconnect" not in mount.options


@pytest.mark.parametrize(
    ("line", "source", "point", "fstype", "kind"),
    [
        (SSHFS, "alice@gpu-box:/data", "/home/alice/remote data", "fuse.sshfs", "network"),
        (S3FS, "s3fs", "/mnt/bucket", "fuse.s3fs", "network"),
        (EXT4, "/dev/nvme0n1p2", "/", "ext4", "local"),
        (XFS, "/dev/md0", "/scratch", "xfs", "local"),
        (TMPFS, "tmpfs", "/dev/shm", "tmpfs", "memory"),
        (OVERLAY, "overlay", "/", "overlay", "local"),
    ],
)
def test_other_filesystems(line: str, source: str, point: str, fstype: str, kind: str) -> None:
    mount = mount_of(line)
    assert (mount.source, mount.mount_point, mount.fstype, mount.kind) == (source, point, fstype, kind)


def test_options_with_colons_and_flags() -> None:
    lower = "/var/lib/docker/overlay2/l/ABC:/var/lib/docker/overlay2/l/DEF"
    assert mount_of(OVERLAY).options["lowerdir"] == lower
    assert mount_of(XFS).options["noquota"] is None


def test_octal_escapes_are_undone() -> None:
    line = "5 1 0:5 / /mnt/x\\011y\\134z rw - nfs server:/a\\040b rw,vers=3"
    mount = mount_info("/mnt/x\ty\\z", mountinfo=line)
    assert mount.source == "server:/a b" and mount.mount_point == "/mnt/x\ty\\z"


def test_a_line_that_is_not_mountinfo_is_refused() -> None:
    with pytest.raises(ConfigError, match="not a mountinfo line"):
        mount_info("/", mountinfo="just two")
    with pytest.raises(ConfigError, match="not a mountinfo line"):  # /proc/mounts format: no " - "
        mount_info("/", mountinfo="/dev/sda1 / ext4 rw,relatime 0 0")


MOUNTS = "\n".join(
    [
        EXT4,
        NFS3,
        NFS4,
        "354 27 0:54 / /mnt/fb-archive rw - nfs fb02:/other rw,vers=3",
        TMPFS,
        "355 27 0:55 / /mnt/stacked rw - tmpfs tmpfs rw",
        "356 355 0:56 / /mnt/stacked rw - nfs fb03:/stacked rw,vers=3,nconnect=4",
        SSHFS,
    ]
)


@pytest.mark.parametrize(
    ("path", "point", "fstype"),
    [
        ("/mnt/fb/run1/step-000001", "/mnt/fb", "nfs"),
        ("/mnt/fb", "/mnt/fb", "nfs"),
        ("/mnt/fb-archive/x", "/mnt/fb-archive", "nfs"),  # not /mnt/fb: a path prefix is not a mount
        ("/mnt/fb4/ckpt", "/mnt/fb4", "nfs4"),
        ("/mnt/fbx", "/", "ext4"),
        ("/mnt/stacked/run", "/mnt/stacked", "nfs"),  # the later of two mounts on one point wins
        ("/home/alice/remote data/ckpt", "/home/alice/remote data", "fuse.sshfs"),
    ],
)
def test_mount_info_takes_the_longest_mount_point(path: str, point: str, fstype: str) -> None:
    mount = mount_info(path, mountinfo=MOUNTS)
    assert (mount.mount_point, mount.fstype) == (point, fstype)


def test_mount_info_of_this_machine(tmp_path: Path) -> None:
    mount = mount_info(tmp_path)
    assert os.fspath(tmp_path).startswith(mount.mount_point.rstrip("/"))
    assert f" - {mount.fstype} " in Path("/proc/self/mountinfo").read_text()


# -- advice rules on synthetic results ------------------------------------------------------------


def result(mount: str = EXT4, **overrides: Any) -> ProbeResult:
    info = mount_of(mount)
    fields: dict[str, Any] = {
        "target": info.mount_point,
        "kind": info.kind,
        "fstype": info.fstype,
        "source": info.source,
        "mount_point": info.mount_point,
        "options": info.options,
        "free_bytes": 10**12,
        "total_bytes": 2 * 10**12,
        "size_bytes": 64 << 20,
        "runs": [StreamRun(n, 64 << 20, 0.1, 0.05) for n in (1, 2, 4, 8)],
        "fsync_ms": 0.5,
        "fsync_p95_ms": 1.0,
        "cache_dropped": True,
    }
    fields.update(overrides)
    return ProbeResult(**fields)


def joined(probe_result: ProbeResult) -> str:
    return "\n".join(_advice(probe_result))


def test_advice_more_streams_when_bandwidth_scales() -> None:
    runs = [StreamRun(n, 1 << 30, 1.0 / min(n, 4), None) for n in (1, 2, 4, 8)]
    text = joined(result(runs=runs))
    assert "writer_threads=4" in text and "1.07 GB/s" in text and "4.29 GB/s" in text


def test_advice_few_streams_when_one_is_enough() -> None:
    text = joined(result())
    assert "do not pay off" in text and "writer_threads=" not in text.split("keep writer_threads")[0]


def test_advice_nfs_without_nconnect() -> None:
    assert "without nconnect" in joined(result(NFS4))
    assert "without nconnect" in joined(result(NFS4.replace("soft,", "soft,nconnect=1,")))


def test_advice_well_mounted_nfs_has_no_mount_complaints() -> None:
    assert "nconnect" not in joined(result(NFS3))


def test_advice_free_space_against_checkpoint_size() -> None:
    assert "below twice the checkpoint" in joined(result(free_bytes=15 * 10**9, checkpoint_bytes=10**10))
    assert "ENOSPC" in joined(result(free_bytes=5 * 10**9, checkpoint_bytes=10**10))
    assert "free space" not in joined(result(free_bytes=10**12, checkpoint_bytes=10**10)).lower()


def test_advice_time_to_persist() -> None:
    text = joined(result(checkpoint_bytes=10**10))  # 10 GB at 0.67 GB/s
    assert "takes about 14.9 s to persist" in text


def test_advice_on_a_memory_filesystem() -> None:
    assert "lost at reboot" in joined(result(TMPFS))
    assert "lost at reboot" not in joined(result(EXT4))


def test_advice_slow_fsync() -> None:
    assert "fsync takes 25.0 ms" in joined(result(fsync_ms=25.0))
    assert "fsync" not in joined(result(fsync_ms=2.0))


def test_advice_when_all_is_fine() -> None:
    runs = [StreamRun(1, 1 << 30, 1.0, 0.5)]
    assert _advice(result(runs=runs)) == [
        "Nothing to change: the measured figures and mount options look fine."
    ]


# -- real probes ----------------------------------------------------------------------------------


def check_measured(found: ProbeResult, streams: tuple[int, ...]) -> None:
    frame = found.to_pandas()
    assert list(frame["streams"]) == list(streams)
    assert {"streams", "write_gbs", "read_gbs"} <= set(frame.columns)
    assert (frame["write_gbs"] > 0).all() and (frame["read_gbs"] > 0).all()
    assert found.fsync_ms is not None and found.fsync_p95_ms is not None
    assert 0 <= found.fsync_ms <= found.fsync_p95_ms
    assert found.advice and found.advice[0] in found.summary()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_probe_tmpfs_leaves_nothing() -> None:
    target = Path("/dev/shm") / f"nbckpt-test-{os.getpid()}"
    found = probe(target, size_mb=4, streams=(1, 2))
    assert not target.exists()  # the probe created it, and removed it again
    assert found.kind == "memory" and found.fstype == "tmpfs" and found.mount_point == "/dev/shm"
    assert found.cache_dropped is False  # tmpfs pages are the data: they cannot be dropped
    check_measured(found, (1, 2))
    assert "tmpfs" in found.summary() and any("lost at reboot" in a for a in found.advice)


def test_probe_local_disk(tmp_path: Path) -> None:
    mount = mount_info(tmp_path)
    if mount.kind == "memory":
        pytest.skip(f"{tmp_path} is on {mount.fstype}, not a disk")
    found = probe(tmp_path, size_mb=4, streams=(1, 2, 4), checkpoint_bytes=10**9)
    assert os.listdir(tmp_path) == []
    assert (found.fstype, found.mount_point, found.kind) == (mount.fstype, mount.mount_point, mount.kind)
    assert found.free_bytes and found.total_bytes and found.free_bytes <= found.total_bytes
    if mount.kind == "local":
        assert found.cache_dropped is True  # fadvise after fsync, checked with mincore
    check_measured(found, (1, 2, 4))
    assert any("checkpoint takes about" in a for a in found.advice)
    body = found.to_dict()
    assert json.loads(json.dumps(body, default=str))["runs"][0]["streams"] == 1


def test_probe_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="size_mb"):
        probe(tmp_path, size_mb=0)
    with pytest.raises(ConfigError, match="streams"):
        probe(tmp_path, streams=(1, 0))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="cannot write in"):
        probe(tmp_path / "file", size_mb=1)


def test_probe_unwritable_target_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="cannot write in /proc/nbckpt-probe"):
        probe("/proc/nbckpt-probe", size_mb=1)


def test_cli_probe_prints_summary_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "probe.json"
    target = tmp_path / "target"
    assert cli(["probe", str(target), "--size-mb", "2", "--streams", "1,2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Storage probe of" in printed and "Advice:" in printed
    body = json.loads(out.read_text())
    assert [run["streams"] for run in body["runs"]] == [1, 2] and body["kind"] in ("local", "network")


def test_cli_bad_streams_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["probe", str(tmp_path), "--streams", "1,x"]) == 2
    assert "--streams" in capsys.readouterr().err


def test_summary_shows_nfs_options_and_every_advice_item() -> None:
    nfs = result(NFS4, checkpoint_bytes=10**10)
    nfs.advice = _advice(nfs)
    text = nfs.summary()
    assert "network (nfs4, 10.0.0.5:/ckpt)" in text
    assert "mounted on /mnt/fb4: rw,noatime,vers=4.1,rsize=65536,wsize=65536,namlen=255,soft," in text
    assert all(item in text for item in nfs.advice)
    rows = re.findall(r"^\s+(\d+)\s+\d+\.\d{3}\s+\d+\.\d{3}$", text, flags=re.MULTILINE)
    assert rows == ["1", "2", "4", "8"]


def test_probe_reports_its_repeats(tmp_path: Path) -> None:
    found = probe(tmp_path, size_mb=2, streams=(1,), repeats=3)
    assert found.repeats == 3 and "best of 3" in found.summary()
    with pytest.raises(ConfigError, match="repeats"):
        probe(tmp_path, size_mb=1, repeats=0)


def test_probe_removes_every_directory_it_made(tmp_path: Path) -> None:
    probe(tmp_path / "a" / "b" / "c", size_mb=1, streams=(1,), repeats=1)
    assert os.listdir(tmp_path) == []


def test_measure_write_makes_its_directory_and_leaves_nothing(tmp_path: Path) -> None:
    runs = measure_write(tmp_path / "new" / "dir", 1 << 20, streams=(1, 2), repeats=2)
    assert [run.streams for run in runs] == [1, 2] and all(run.read_s is None for run in runs)
    assert all(len(run.write_rounds_s) == 2 and run.write_s == min(run.write_rounds_s) for run in runs)
    assert os.listdir(tmp_path) == []


def test_the_page_cache_check_sees_cached_and_dropped_pages(tmp_path: Path) -> None:
    if mount_info(tmp_path).kind != "local":
        pytest.skip(f"{tmp_path} is not on a local disk")
    path = tmp_path / "data"
    with open(path, "wb") as stream:
        stream.write(os.urandom(4 << 20))
        stream.flush()
        os.fsync(stream.fileno())
        assert cached_fraction(str(path)) == 1.0  # just written: every page is in memory
        os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    assert (cached_fraction(str(path)) or 0.0) < 0.1
    assert cached_fraction(str(tmp_path / "missing")) is None


def test_floors_read_back_from_json_with_nulls_and_lists() -> None:
    body = {
        "bytes": 10,
        "copy_s": None,
        "copy_gbs": 1.0,
        "write_gbs": 2.0,
        "write_gbs_rounds": [1.5, None],
        "write_gbs_by_streams": {"1": 2.0, "2": None},
        "a_later_field": 1,
    }
    floors = Floors.from_dict(body)
    assert floors.bytes == 10 and math.isnan(floors.copy_s) and floors.write_gbs == 2.0
    assert floors.write_gbs_rounds[0] == 1.5 and math.isnan(floors.write_gbs_rounds[1])
    assert isinstance(floors.write_gbs_rounds, tuple) and math.isnan(floors.write_gbs_by_streams["2"])
    assert "floors for 10 B" in floors.describe()


def test_the_concurrent_write_times_its_write_from_its_release_not_its_preparation(tmp_path: Path) -> None:
    """The bench's concurrent floor (every rank at once): the directory is made before the
    ranks are released, and the span it reports starts after the release, with nothing left."""
    seen: dict[str, Any] = {}

    def start() -> None:  # what the barrier of every rank does: release the write
        (work,) = tmp_path.iterdir()
        seen["files"] = sorted(os.listdir(work))
        seen["released_ns"] = time.time_ns()

    begin, end = concurrent_write(tmp_path, 3 * 2**20 + 5, start=start)
    assert seen["files"] == []  # prepared, nothing written before the release
    assert seen["released_ns"] <= begin < end
    assert list(tmp_path.iterdir()) == []
