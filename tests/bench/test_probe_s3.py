"""The storage probe against a real S3 server (SeaweedFS): measures, cleans up, explains errors."""

from __future__ import annotations

import uuid

import pytest
from helpers.s3server import KEY, SeaweedS3

from nbckpt.bench import probe
from nbckpt.cli import main as cli

pytestmark = [pytest.mark.s3, pytest.mark.xdist_group("s3")]


@pytest.fixture
def bucket(s3_server: SeaweedS3) -> str:
    name = f"nbckpt-{uuid.uuid4().hex[:10]}"
    s3_server.make_bucket(name)
    return name


def test_probe_object_store_measures_and_leaves_nothing(s3_server: SeaweedS3, bucket: str) -> None:
    found = probe(
        f"s3://{bucket}/probe",
        size_mb=12,
        streams=(1, 2),
        repeats=1,
        storage_options=s3_server.storage_options(),
    )
    frame = found.to_pandas()
    assert found.kind == "object" and found.source == s3_server.endpoint_url
    assert list(frame["streams"]) == [1, 2] and (frame["write_gbs"] > 0).all()
    assert (frame["read_gbs"] > 0).all() and found.cache_dropped is None and found.fsync_ms is None
    assert found.fstype == "s3" and found.advice and found.advice[0] in found.summary()
    assert s3_server.filesystem().find(bucket) == []


def test_cli_probe_s3_with_wrong_secret_is_a_one_line_error(
    s3_server: SeaweedS3, bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "probe",
        f"s3://{bucket}/p",
        "--size-mb",
        "1",
        "--endpoint-url",
        s3_server.endpoint_url,
        "--option",
        f"key={KEY}",
        "--option",
        "secret=wrong",
    ]
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "access denied" in err and s3_server.endpoint_url in err
