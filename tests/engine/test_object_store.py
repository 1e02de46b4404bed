"""Checkpoints on S3 against a real SeaweedFS server: round trip, errors, crashes, retention."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import crash_child
from helpers.finetune import setup, snapshot, tune
from helpers.s3server import KEY, SECRET, SeaweedS3

from nbckpt import Checkpointer, CheckpointError
from nbckpt.engine._faults import armed
from nbckpt.engine._open_store import open_store

pytestmark = [pytest.mark.s3, pytest.mark.xdist_group("s3")]

CRASH_CHILD = Path(crash_child.__file__)


@pytest.fixture
def bucket(s3_server: SeaweedS3) -> str:
    name = f"nbckpt-{uuid.uuid4().hex[:10]}"
    s3_server.make_bucket(name)
    return name


def trained(seed: int = 0, width: int = 64) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, width)).pow(2).mean().backward()
    optim.step()
    return model, optim


def assert_equal_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), key
        elif isinstance(value, dict):
            assert_equal_state(value, b[key])
        else:
            assert value == b[key], key


def keys_under(server: SeaweedS3, root: str) -> list[str]:
    fs = server.filesystem()
    return sorted(p.removeprefix(root + "/") for p in fs.find(root))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_round_trip_is_bit_exact(s3_server: SeaweedS3, bucket: str, mode: str) -> None:
    model, optim = trained()
    url = f"s3://{bucket}/runs/{mode}"
    with Checkpointer(url, mode=mode, storage_options=s3_server.storage_options()) as ckpt:  # type: ignore[arg-type]
        record = ckpt.save({"model": model, "optim": optim, "step": 5, "lr": 0.1}, step=5).wait()
        assert record.path == f"{url}/step-000005" and record.bytes > 0
        assert ckpt.steps() == [5]
        manifest = ckpt.verify(5)
    files = keys_under(s3_server, f"{bucket}/runs/{mode}")
    assert files == sorted(f"step-000005/{name}" for name in [*manifest["files"], "manifest.json"])

    fresh_model, fresh_optim = trained(seed=1)
    state: dict[str, Any] = {"model": fresh_model, "optim": fresh_optim, "step": 0, "lr": 0.0}
    with Checkpointer(url, storage_options=s3_server.storage_options()) as ckpt:
        assert ckpt.restore(state) == 5
    assert state["step"] == 5 and state["lr"] == 0.1
    assert_equal_state(fresh_model.state_dict(), model.state_dict())
    assert_equal_state(fresh_optim.state_dict(), optim.state_dict())


def test_credentials_from_aws_environment(
    s3_server: SeaweedS3, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    model, _ = trained()
    with Checkpointer(f"s3://{bucket}/env", mode="sync") as ckpt:
        ckpt.save({"model": model}, step=1)
        assert ckpt.steps() == [1]


def test_wrong_credentials_name_the_endpoint_and_write_nothing(s3_server: SeaweedS3, bucket: str) -> None:
    options = s3_server.storage_options(secret="not-the-secret")
    with pytest.raises(CheckpointError) as caught:
        Checkpointer(f"s3://{bucket}/run", storage_options=options)
    message = str(caught.value)
    assert s3_server.endpoint_url in message and "access denied" in message
    assert s3_server.filesystem().find(bucket) == []


def test_missing_bucket_is_a_clear_error(s3_server: SeaweedS3) -> None:
    with pytest.raises(CheckpointError, match=r"bucket 'nbckpt-no-such-bucket' does not exist"):
        Checkpointer("s3://nbckpt-no-such-bucket/run", storage_options=s3_server.storage_options())


def test_server_crash_during_background_save(s3_server: SeaweedS3, bucket: str) -> None:
    url = f"s3://{bucket}/crash"
    model, optim = trained()
    committed = {"model": model, "optim": optim, "step": 1}
    ckpt = Checkpointer(url, mode="async", storage_options=s3_server.storage_options())
    ckpt.save(committed, step=1).wait()

    big = {"weights": torch.randn(8 << 20)}  # 32 MiB: its upload is still running below
    with pytest.warns(UserWarning, match="step 2 holds 'weights'"):
        handle = ckpt.save(big, step=2)
    s3_server.pause()  # freeze mid-upload: the save cannot have committed
    assert not handle.done()
    s3_server.kill()
    with pytest.raises(CheckpointError, match="save of step 2") as caught:
        handle.wait(timeout=120)
    assert caught.value.__cause__ is not None
    ckpt.close()  # already reported: closing does not raise it again

    s3_server.restart()
    state: dict[str, Any] = {"model": trained(seed=3)[0], "optim": trained(seed=3)[1], "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a partial step 2 may or may not have been left
        reopened = Checkpointer(url, storage_options=s3_server.storage_options())
    with reopened:
        assert reopened.steps() == [1]
        reopened.verify(1)
        assert reopened.restore(state) == 1
    assert_equal_state(state["model"].state_dict(), model.state_dict())
    assert_equal_state(state["optim"].state_dict(), optim.state_dict())
    assert all(key.startswith("step-000001/") for key in keys_under(s3_server, f"{bucket}/crash"))


def test_retention_deletes_only_after_a_newer_commit(s3_server: SeaweedS3, bucket: str) -> None:
    model, optim = trained()
    url = f"s3://{bucket}/keep"
    with Checkpointer(url, keep=2, storage_options=s3_server.storage_options()) as ckpt:
        for step in range(1, 5):
            ckpt.save({"model": model, "optim": optim, "step": step}, step=step)
        ckpt.wait()
        assert ckpt.steps() == [3, 4]
        events = ckpt.timeline.events
    keys = keys_under(s3_server, f"{bucket}/keep")
    assert {key.split("/")[0] for key in keys} == {"step-000003", "step-000004"}
    commits = {e.step: e.end_ns for e in events if e.kind == "commit"}
    deletes = [e for e in events if e.kind == "delete"]
    assert sorted(e.step for e in deletes) == [1, 2]
    for delete in deletes:
        assert delete.step is not None
        assert commits[delete.step + 2] is not None
        assert commits[delete.step + 2] <= delete.start_ns


def test_prefix_without_manifest_never_counts_and_is_cleaned(s3_server: SeaweedS3, bucket: str) -> None:
    url = f"s3://{bucket}/partial"
    model, _ = trained()
    with Checkpointer(url, mode="sync", storage_options=s3_server.storage_options()) as ckpt:
        ckpt.save({"model": model}, step=3)
    fs = s3_server.filesystem()
    fs.pipe_file(f"{bucket}/partial/step-000007/__0_0.distcp", b"half a checkpoint")
    store = open_store(url, s3_server.storage_options())
    assert list(store.committed()) == [3]
    with pytest.warns(UserWarning, match="step-000007"):
        ckpt = Checkpointer(url, storage_options=s3_server.storage_options())
    with ckpt:
        assert ckpt.steps() == [3] and ckpt.latest_step() == 3
    assert not fs.exists(f"{bucket}/partial/step-000007/__0_0.distcp")


@pytest.mark.parametrize(
    ("crash_at", "args", "committed", "left"),
    [
        ("after_data", ["--steps", "1"], [], "step-000000"),
        ("during_delete", ["--steps", "2", "--keep", "1"], [1], "step-000000"),
    ],
)
def test_killed_writer_leaves_nothing_that_counts(
    s3_server: SeaweedS3, bucket: str, crash_at: str, args: list[str], committed: list[int], left: str
) -> None:
    url = f"s3://{bucket}/killed"
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_ENDPOINT_URL": s3_server.endpoint_url,
    }
    child = subprocess.run(
        [sys.executable, str(CRASH_CHILD), url, "--crash-at", crash_at, *args],
        env=env,
        capture_output=True,
        timeout=300,
    )
    assert child.returncode == -9, child.stderr.decode()[-2000:]
    keys = keys_under(s3_server, f"{bucket}/killed")
    assert any(key.startswith(f"{left}/") for key in keys)  # the data is there ...
    assert f"{left}/manifest.json" not in keys  # ... but not the manifest
    assert list(open_store(url, s3_server.storage_options()).committed()) == committed
    with pytest.warns(UserWarning, match=left):
        ckpt = Checkpointer(url, storage_options=s3_server.storage_options())
    with ckpt:
        assert ckpt.steps() == committed
    assert not any(key.startswith(f"{left}/") for key in keys_under(s3_server, f"{bucket}/killed"))


def test_corrupt_object_falls_back_to_the_older_checkpoint(s3_server: SeaweedS3, bucket: str) -> None:
    url = f"s3://{bucket}/corrupt"
    models = {step: trained(seed=step)[0] for step in (1, 2)}
    with Checkpointer(url, mode="sync", storage_options=s3_server.storage_options()) as ckpt:
        for step, model in models.items():
            ckpt.save({"model": model}, step=step)
    fs = s3_server.filesystem()
    data = sorted(key for key in fs.find(f"{bucket}/corrupt/step-000002") if key.endswith(".distcp"))
    body = bytearray(fs.cat_file(data[0]))
    body[len(body) // 2] ^= 0xFF  # one flipped bit pattern, same size
    fs.pipe_file(data[0], bytes(body))

    state = {"model": trained(seed=9)[0]}
    with Checkpointer(url, storage_options=s3_server.storage_options()) as ckpt:
        with pytest.raises(CheckpointError, match="checksum"):
            ckpt.verify(2)
        with pytest.warns(UserWarning, match="skipping step-000002"):
            assert ckpt.restore(state) == 1
    assert_equal_state(state["model"].state_dict(), models[1].state_dict())


def test_reading_a_step_is_one_check_that_sees_another_writers_commit(
    s3_server: SeaweedS3, bucket: str
) -> None:
    """The browser reads a run step by step: no listing per step (N steps would cost N² requests),
    and a step another process committed since is seen, not hidden by fsspec's listing cache."""
    url, options = f"s3://{bucket}/reader", s3_server.storage_options()
    state = {"w": torch.arange(1000.0), "step": 1}
    with Checkpointer(url, storage_options=options) as writer:
        writer.save(state, step=1).wait()
        with Checkpointer(url, storage_options=options, read_only=True) as reader:
            listings: list[str] = []
            with armed("store.names", listings.append):
                assert reader.manifest(1)["step"] == 1
                with pytest.raises(CheckpointError, match="no committed checkpoint for step 2"):
                    reader.manifest(2)
                listed_for_the_error = len(listings)  # naming the steps there are lists, once
                writer.save({**state, "step": 2}, step=2).wait()
                assert reader.manifest(2)["step"] == 2
                assert torch.equal(reader.load(2)["w"], state["w"])
                assert len(listings) == listed_for_the_error <= 1
                reader.steps()  # a listing, seen: the seam is where the run is listed
            assert len(listings) > listed_for_the_error


def test_incremental_saves_copy_unchanged_files_on_the_server(s3_server: SeaweedS3, bucket: str) -> None:
    """Issue 32 on a real S3 server: the frozen base's files of each step are server-side copies
    of the step before's (no bytes through the client), and each step stays whole when the steps
    before it are deleted."""
    model, optim, state = setup()
    base = sum(p.nbytes for p in model.base.parameters())
    url = f"s3://{bucket}/incremental"
    expected = {}
    with Checkpointer(
        url, mode="sync", incremental=True, storage_options=s3_server.storage_options()
    ) as ckpt:  # type: ignore[arg-type]
        for step in (1, 2, 3):
            tune(model, optim, step)
            state["step"] = step
            record = ckpt.save(state, step=step).wait()
            expected[step] = snapshot(state)
            assert (record.bytes_skipped > base) == (step > 1)
            assert record.bytes_written < (base if step > 1 else record.bytes_written + 1)
        tune(model, optim, 4)  # saved again as step 3: S3 deletes the old copy first, nothing is shared
        record = ckpt.save(state, step=3, overwrite=True).wait()
        expected[3] = snapshot(state)
        assert record.bytes_skipped == 0
        ckpt.delete(1)
        ckpt.delete(2)
        ckpt.verify(3)
        fresh_model, fresh_optim, fresh = setup(seed=5)
        tune(fresh_model, fresh_optim, 0)
        assert ckpt.restore(fresh) == 3
    assert_equal_state(snapshot(fresh), expected[3])


REWIND_CHILD = """
import json, sys, torch
from nbckpt import Checkpointer
from nbckpt.engine._store import arm_crash
url, options, point = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
ckpt = Checkpointer(url, mode="sync", storage_options=options)
for step in (10, 20, 30, 40):
    ckpt.save({"w": torch.full((8,), float(step))}, step=step)
ckpt.restore({"w": torch.zeros(8)}, step=20)
arm_crash(point)
ckpt.save({"w": torch.full((8,), 25.0)}, step=25)
"""


def holds(ckpt: Checkpointer, step: int) -> bool:
    state = {"w": torch.zeros(8)}
    return ckpt.restore(state, step=step) == step and torch.equal(state["w"], torch.full((8,), float(step)))


@pytest.mark.parametrize("point", [None, "set_aside_copied"])
def test_a_rewind_sets_steps_aside_on_s3_by_server_side_copies_even_across_a_kill(
    s3_server: SeaweedS3, bucket: str, point: str | None
) -> None:
    """On S3 a step is set aside by copying its objects (the manifest last) and then deleting
    them (the manifest first). Killed between the two, the step is whole in both places: the next
    open finishes the move, and every step restores from exactly one place, bit for bit."""
    url, options = f"s3://{bucket}/run", s3_server.storage_options()
    child = subprocess.run(
        [sys.executable, "-c", REWIND_CHILD, url, json.dumps(options), point or "none"],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert child.returncode == (-9 if point else 0), child.stderr
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = Checkpointer(url, storage_options=options)
    finished = [w for w in caught if "finished setting steps aside" in str(w.message)]
    assert len(finished) == (1 if point else 0)
    with ckpt:
        assert ckpt.steps() == ([10, 20] if point else [10, 20, 25]) and holds(ckpt, 20)
        [entry] = ckpt.set_aside_runs()
    assert (entry["path"], entry["after"], entry["steps"]) == (f"{url}/set-aside-1", 20, [30, 40])
    with Checkpointer(entry["path"], read_only=True, storage_options=options) as aside:
        assert holds(aside, 30) and holds(aside, 40)
        aside.verify(30)
    keys = keys_under(s3_server, f"{bucket}/run")
    assert not [k for k in keys if k.startswith(("step-000030", "step-000040", ".set-aside"))], keys
