"""The storage probe: mount-line parser, mount lookup, advice rules, real probes of tmpfs and disk."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from nbckpt import ConfigError
from nbckpt.bench import ProbeResult, mount_info, probe
from nbckpt.bench._advice import storage_advice
from nbckpt.bench._measure import StreamRun
from nbckpt.bench._mounts import parse_mount_line
from nbckpt.cli import main as cli

NFS3 = (
    "fb01-data.example.com:/ckpt /mnt/fb nfs rw,relatime,vers=3,rsize=1048576,wsize=1048576,"
    "namlen=255,hard,nconnect=8,proto=tcp,timeo=600,retrans=2,sec=sys,mountaddr=10.0.0.5,"
    "mountvers=3,mountport=2049,mountproto=tcp,local_lock=none,addr=10.0.0.5 0 0"
)
NFS4 = (
    "10.0.0.5:/ckpt /mnt/fb4 nfs4 rw,noatime,vers=4.1,rsize=65536,wsize=65536,namlen=255,soft,"
    "proto=tcp,timeo=600,retrans=2,sec=sys,clientaddr=10.0.0.9,local_lock=none,addr=10.0.0.5 0 0"
)
SSHFS = (
    "alice@gpu-box:/data /home/alice/remote\\040data fuse.sshfs "
    "rw,nosuid,nodev,relatime,user_id=1000,group_id=1000 0 0"
)
S3FS = "s3fs /mnt/bucket fuse.s3fs rw,nosuid,nodev,relatime,user_id=0,group_id=0,allow_other 0 0"
EXT4 = "/dev/nvme0n1p2 / ext4 rw,relatime,errors=remount-ro 0 0"
XFS = (
    "/dev/md0 /scratch xfs rw,noatime,attr2,inode64,logbufs=8,logbsize=32k,sunit=1024,swidth=4096,"
    "noquota 0 0"
)
TMPFS = "tmpfs /dev/shm tmpfs rw,nosuid,nodev,size=65536k,inode64 0 0"
OVERLAY = (
    "overlay / overlay rw,relatime,lowerdir=/var/lib/docker/overlay2/l/ABC:/var/lib/docker/overlay2/l/DEF,"
    "upperdir=/var/lib/docker/overlay2/123/diff,workdir=/var/lib/docker/overlay2/123/work 0 0"
)


def test_parse_nfs3_with_nconnect() -> None:
    mount = parse_mount_line(NFS3)
    assert mount.source == "fb01-data.example.com:/ckpt"
    assert (mount.mount_point, mount.fstype) == ("/mnt/fb", "nfs")
    assert mount.kind == "network" and mount.is_nfs
    assert mount.nfs_options == {
        "vers": "3", "nconnect": "8", "rsize": "1048576", "wsize": "1048576", "proto": "tcp",
        "hard": None, "timeo": "600", "retrans": "2", "sec": "sys", "addr": "10.0.0.5",
    }
    assert mount.option_int("wsize") == 1 << 20


def test_parse_nfs4() -> None:
    mount = parse_mount_line(NFS4)
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
def test_parse_other_filesystems(line: str, source: str, point: str, fstype: str, kind: str) -> None:
    mount = parse_mount_line(line)
    assert (mount.source, mount.mount_point, mount.fstype, mount.kind) == (source, point, fstype, kind)
    assert mount.nfs_options == {}


def test_parse_keeps_options_with_colons_and_flags() -> None:
    mount = parse_mount_line(OVERLAY)
    assert mount.options["lowerdir"] == "/var/lib/docker/overlay2/l/ABC:/var/lib/docker/overlay2/l/DEF"
    assert parse_mount_line(XFS).options["noquota"] is None


def test_parse_unescapes_octal() -> None:
    mount = parse_mount_line("server:/a\\040b /mnt/x\\011y\\134z nfs rw,vers=3 0 0")
    assert mount.source == "server:/a b" and mount.mount_point == "/mnt/x\ty\\z"


def test_parse_rejects_garbage() -> None:
    with pytest.raises(ConfigError, match="not a mount line"):
        parse_mount_line("just two")


MOUNTS = "\n".join([
    EXT4, NFS3, NFS4,
    "fb02:/other /mnt/fb-archive nfs rw,vers=3 0 0",
    TMPFS,
    "tmpfs /mnt/stacked tmpfs rw 0 0",
    "fb03:/stacked /mnt/stacked nfs rw,vers=3,nconnect=4 0 0",
    SSHFS,
])


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
    mount = mount_info(path, mounts=MOUNTS)
    assert (mount.mount_point, mount.fstype) == (point, fstype)


def test_mount_info_of_this_machine(tmp_path: Path) -> None:
    mount = mount_info(tmp_path)
    assert os.fspath(tmp_path).startswith(mount.mount_point.rstrip("/"))
    assert mount.fstype in Path("/proc/mounts").read_text()


# -- advice rules on synthetic results ------------------------------------------------------------


def result(mount: str = EXT4, **overrides: Any) -> ProbeResult:
    info = parse_mount_line(mount)
    fields: dict[str, Any] = {
        "target": info.mount_point, "kind": info.kind, "fstype": info.fstype, "source": info.source,
        "mount_point": info.mount_point, "options": info.options, "free_bytes": 10**12,
        "total_bytes": 2 * 10**12, "size_bytes": 64 << 20,
        "runs": [StreamRun(n, 64 << 20, 0.1, 0.05) for n in (1, 2, 4, 8)],
        "fsync_ms": 0.5, "fsync_p95_ms": 1.0, "create_per_s": 20000.0, "rename_per_s": 20000.0,
        "delete_per_s": 20000.0, "cache_dropped": True,
    }
    fields.update(overrides)
    return ProbeResult(**fields)


def joined(probe_result: ProbeResult) -> str:
    return "\n".join(storage_advice(probe_result))


def test_advice_more_streams_when_bandwidth_scales() -> None:
    runs = [StreamRun(n, 1 << 30, 1.0 / min(n, 4), None) for n in (1, 2, 4, 8)]
    text = joined(result(runs=runs))
    assert "writer_threads=4" in text and "1.07 GB/s" in text and "4.29 GB/s" in text


def test_advice_few_streams_when_one_is_enough() -> None:
    text = joined(result())
    assert "do not pay off" in text and "writer_threads=" not in text.split("keep writer_threads")[0]


def test_advice_nfs_without_nconnect_and_small_rsize_and_soft() -> None:
    text = joined(result(NFS4))
    assert "without nconnect" in text
    assert "rsize=65536 is below 1 MiB" in text and "wsize=65536 is below 1 MiB" in text
    assert "soft mount" in text


def test_advice_well_mounted_nfs_has_no_mount_complaints() -> None:
    text = joined(result(NFS3))
    assert "nconnect" not in text and "below 1 MiB" not in text and "soft" not in text


def test_advice_nfs_v40_and_udp() -> None:
    text = joined(result("srv:/x /mnt/x nfs4 rw,vers=4.0,proto=udp,nconnect=4 0 0"))
    assert "vers=4.0" in text and "proto=udp" in text


def test_advice_free_space_against_checkpoint_size() -> None:
    assert "less than twice the checkpoint" in joined(result(free_bytes=15 * 10**9, checkpoint_bytes=10**10))
    assert "ENOSPC" in joined(result(free_bytes=5 * 10**9, checkpoint_bytes=10**10))
    assert "free space" not in joined(result(free_bytes=10**12, checkpoint_bytes=10**10)).lower()


def test_advice_time_to_persist() -> None:
    text = joined(result(checkpoint_bytes=10**10))  # 10 GB at 0.67 GB/s
    assert "takes about 14.9 s to persist" in text


@pytest.mark.parametrize(
    ("mount", "expected"),
    [(TMPFS, "lost at reboot"), (OVERLAY, "overlay filesystem"), (S3FS, "FUSE filesystem"),
     (SSHFS, "use the s3:// URL")],
)
def test_advice_on_filesystem_kinds(mount: str, expected: str) -> None:
    assert expected in joined(result(mount))


def test_advice_slow_fsync_metadata_and_cache() -> None:
    text = joined(result(fsync_ms=25.0, create_per_s=80.0, cache_dropped=False))
    assert "fsync takes 25.0 ms" in text and "80 file creates/s" in text and "page cache" in text


def test_advice_when_all_is_fine() -> None:
    runs = [StreamRun(1, 1 << 30, 1.0, 0.5)]
    assert storage_advice(result(runs=runs)) == [
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
    assert found.create_per_s and found.rename_per_s and found.delete_per_s
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
    with pytest.raises(ConfigError, match="cannot probe"):
        probe(tmp_path / "file", size_mb=1)


def test_probe_unwritable_target_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="cannot probe /proc/nbckpt-probe"):
        probe("/proc/nbckpt-probe", size_mb=1)


def test_cli_probe_prints_summary_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
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
    nfs.advice = storage_advice(nfs)
    text = nfs.summary()
    assert "network (nfs4, 10.0.0.5:/ckpt)" in text
    assert "NFS: vers=4.1,rsize=65536,wsize=65536,proto=tcp,soft,timeo=600" in text
    assert all(item in text for item in nfs.advice)
    rows = re.findall(r"^\s+(\d+)\s+\d+\.\d{3}\s+\d+\.\d{3}$", text, flags=re.MULTILINE)
    assert rows == ["1", "2", "4", "8"]


def test_probe_reports_its_repeats(tmp_path: Path) -> None:
    found = probe(tmp_path, size_mb=2, streams=(1,), repeats=3)
    assert found.repeats == 3 and "best of 3" in found.summary()
    with pytest.raises(ConfigError, match="repeats"):
        probe(tmp_path, size_mb=1, repeats=0)
