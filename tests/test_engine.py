"""The engine: round trips, phases, retention, backpressure, errors, corruption, lock, interop."""

from __future__ import annotations

import json
import os
import random
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from _sync import main_thread_blocked, until
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from nbckpt import Checkpointer, CheckpointError, ConfigError
from nbckpt._dcp import HashingFileSystem


def trained_model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(8, 32)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def fresh_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def assert_same_state(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            assert_same_state(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_state(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_round_trip_is_bit_exact(tmp_path: Path, mode: str) -> None:
    model, optim = trained_model()
    extra = {"lr": 0.5, "betas": (0.9, 0.99), "name": "run", "ids": [1, 2, 3], "none": None, "flag": True}
    with Checkpointer(tmp_path, mode=mode) as ckpt:  # type: ignore[arg-type]
        record = ckpt.save({"model": model, "optim": optim, "step": 7, "extra": extra}, step=7).wait()
    assert record.step == 7 and record.bytes > 0 and record.persist_s > 0 and record.write_gbs > 0
    assert record.path.endswith("step-000007")

    model2, optim2 = fresh_model()
    state = {"model": model2, "optim": optim2, "step": 0, "extra": None}
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.restore(state) == 7
    assert state["step"] == 7
    assert state["extra"] == extra
    assert_same_state(model.state_dict(), model2.state_dict())
    assert_same_state(optim.state_dict(), optim2.state_dict())


def test_rng_capture_continues_bit_identically(tmp_path: Path) -> None:
    torch.manual_seed(1)
    np.random.seed(1)
    random.seed(1)
    with Checkpointer(tmp_path, capture_rng=True) as ckpt:
        ckpt.save({"x": torch.zeros(2)}, step=1).wait()
        expected = (torch.rand(4), np.random.rand(3), random.random())
        torch.rand(100)
        np.random.rand(5)
        random.random()
        ckpt.restore({"x": torch.zeros(2)})
        got = (torch.rand(4), np.random.rand(3), random.random())
    assert torch.equal(expected[0], got[0])
    assert np.array_equal(expected[1], got[1])
    assert expected[2] == got[2]


def test_plain_tensors_and_numpy_restore_in_place(tmp_path: Path) -> None:
    saved = {"t": torch.arange(6, dtype=torch.int64).reshape(2, 3), "a": np.arange(4, dtype=np.float64)}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(saved, step=1).wait()
        target = torch.zeros(2, 3, dtype=torch.int64)
        state = {"t": target, "a": None}
        ckpt.restore(state)
    assert state["t"] is target and torch.equal(target, saved["t"])
    assert np.array_equal(state["a"], saved["a"])


def test_overlap_returns_before_staging_and_wait_staged(tmp_path: Path) -> None:
    big = {"w": torch.randn(4_000_000)}
    with Checkpointer(tmp_path) as ckpt:
        handle = ckpt.save(big, step=1, overlap=True)
        handle.wait_staged()
        expected = big["w"].clone()
        big["w"].add_(1.0)  # mutating after wait_staged must not change the checkpoint
        handle.wait()
        out = {"w": torch.zeros(4_000_000)}
        ckpt.restore(out)
    assert torch.equal(out["w"], expected)


def test_timeline_records_every_phase(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, keep=1) as ckpt:
        for step in (1, 2):
            ckpt.save({"w": torch.ones(1000)}, step=step)
        ckpt.wait()
        ckpt.restore({"w": torch.zeros(1000)})
        df = ckpt.timeline.to_pandas()
    kinds = set(df["kind"])
    assert {"stall", "stage", "persist", "fsync", "commit", "delete", "restore"} <= kinds
    persist = df[df.kind == "persist"]
    assert list(persist["step"]) == [1, 2] and (persist["bytes"] == 4000).all()
    assert (df["end_s"] >= df["start_s"]).all()
    assert set(df["thread"]) >= {"MainThread", "nbckpt-persist"}


def test_retention_deletes_only_after_newer_commit(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, keep=2) as ckpt:
        for step in range(1, 6):
            ckpt.save({"w": torch.full((10,), float(step))}, step=step).wait()
            assert ckpt.steps()[-1] == step and len(ckpt.steps()) == min(step, 2)
    assert sorted(os.listdir(tmp_path)) == [".nbckpt.lock", "step-000004", "step-000005"]


def test_keep_none_keeps_everything(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ckpt:
        for step in range(4):
            ckpt.save({"w": torch.zeros(3)}, step=step)
        ckpt.wait()
        assert ckpt.steps() == [0, 1, 2, 3] and ckpt.latest_step() == 3


def test_backpressure_waits_and_bounds_inflight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    original = HashingFileSystem.create_stream

    def slow_create_stream(self: HashingFileSystem, path: str, mode: str):  # type: ignore[no-untyped-def]
        gate.wait(timeout=30)
        return original(self, path, mode)

    monkeypatch.setattr(HashingFileSystem, "create_stream", slow_create_stream)
    with Checkpointer(tmp_path, max_inflight=1) as ckpt:
        first = ckpt.save({"w": torch.zeros(10)}, step=1)
        assert not first.done()

        def release_once_save_blocks() -> None:
            blocked.append(until(main_thread_blocked))
            gate.set()

        blocked: list[bool] = []
        threading.Thread(target=release_once_save_blocks, daemon=True).start()
        second = ckpt.save({"w": torch.zeros(10)}, step=2)
        assert blocked == [True]  # save() waited for the first save: backpressure
        assert first.done()  # the second save could only start after the first committed
        assert len(ckpt._inflight) <= 1  # private, but it is the bound under test
        second.wait()


def test_background_error_surfaces_once_and_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save({"w": torch.ones(5)}, step=1).wait()
        original = HashingFileSystem.create_stream

        def failing(self: HashingFileSystem, path: str, mode: str):  # type: ignore[no-untyped-def]
            if "w" in mode:
                raise OSError(28, "No space left on device", str(path))
            return original(self, path, mode)

        monkeypatch.setattr(HashingFileSystem, "create_stream", failing)
        ckpt.save({"w": torch.ones(5)}, step=2)
        with pytest.raises(CheckpointError, match="ENOSPC") as info:
            ckpt.wait()
        assert info.value.__cause__ is not None
        ckpt.wait()  # reported once
        monkeypatch.setattr(HashingFileSystem, "create_stream", original)
        ckpt.save({"w": torch.ones(5)}, step=3).wait()
        assert ckpt.steps() == [1, 3]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]


def test_background_error_raised_from_next_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(self: HashingFileSystem, path: str, mode: str):  # type: ignore[no-untyped-def]
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(HashingFileSystem, "create_stream", failing)
    ckpt = Checkpointer(tmp_path)
    handle = ckpt.save({"w": torch.ones(5)}, step=1)
    while not handle.done():
        handle.committed.exception()
    with pytest.raises(CheckpointError, match="EACCES"):
        ckpt.save({"w": torch.ones(5)}, step=2)
    monkeypatch.undo()
    ckpt.close()


def test_corrupt_newest_falls_back_with_warning(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            ckpt.save({"w": torch.full((100,), float(step))}, step=step).wait()
    data = next((tmp_path / "step-000002").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    out = {"w": torch.zeros(100)}
    with Checkpointer(tmp_path) as ckpt:
        with pytest.warns(UserWarning, match=data.name):
            assert ckpt.restore(out) == 1
        with pytest.raises(CheckpointError, match="checksum"):
            ckpt.restore(out, step=2)
    assert torch.equal(out["w"], torch.full((100,), 1.0))


def test_missing_entry_and_unknown_step(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save({"w": torch.zeros(2)}, step=1).wait()
        with pytest.raises(CheckpointError, match="no committed checkpoint for step 9"):
            ckpt.restore({"w": torch.zeros(2)}, step=9)
        with pytest.warns(UserWarning, match="no entry 'other'"), pytest.raises(CheckpointError):
            ckpt.restore({"other": torch.zeros(2)})


def test_lock_stops_a_second_writer(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as first:
        first.save({"w": torch.ones(3)}, step=1).wait()
        with pytest.raises(CheckpointError, match="in use by another Checkpointer"):
            Checkpointer(tmp_path)
        assert first.steps() == [1]
    Checkpointer(tmp_path).close()  # released on close


def test_stale_temporaries_are_removed_with_a_warning(tmp_path: Path) -> None:
    (tmp_path / ".tmp-step-000005-abc123").mkdir()
    (tmp_path / ".tmp-step-000005-abc123" / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / ".trash-step-000001-def456").mkdir()
    with pytest.warns(UserWarning, match="removed 2 stale"):
        Checkpointer(tmp_path).close()
    assert os.listdir(tmp_path) == [".nbckpt.lock"]


def test_directory_without_manifest_never_counts(tmp_path: Path) -> None:
    (tmp_path / "step-000009").mkdir(parents=True)
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.steps() == [] and ckpt.latest_step() is None
        with pytest.raises(CheckpointError, match="no valid checkpoint"):
            ckpt.restore({"w": torch.zeros(1)})


def test_dcp_reads_nbckpt_checkpoints_without_nbckpt(tmp_path: Path) -> None:
    model, _ = trained_model()
    with Checkpointer(tmp_path) as ckpt:
        path = ckpt.save({"model": model}, step=3).wait().path
    target = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp_load(target, checkpoint_id=path, no_dist=True)
    assert_same_state(target["model"], model.state_dict())


def test_manifest_contents(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ckpt:
        record = ckpt.save({"w": torch.ones(10), "step": 4}, step=4).wait()
        manifest = json.loads((Path(record.path) / "manifest.json").read_text())
        assert manifest == ckpt.verify(4)
    assert manifest["step"] == 4 and manifest["bytes"] == 40 and manifest["world_size"] == 1
    assert ".metadata" in manifest["files"]
    for name, meta in manifest["files"].items():
        assert (Path(record.path) / name).stat().st_size == meta["size"] and len(meta["xxh3_64"]) == 16
    assert manifest["torch_version"] == torch.__version__ and manifest["checksum"]


def test_saving_a_step_again_replaces_it(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save({"w": torch.zeros(3)}, step=1).wait()
        ckpt.save({"w": torch.ones(3)}, step=1).wait()
        out = {"w": torch.zeros(3)}
        ckpt.restore(out)
        assert ckpt.steps() == [1] and torch.equal(out["w"], torch.ones(3))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "fast"}, "mode must be"),
        ({"keep": 0}, "keep must be"),
        ({"max_inflight": 0}, "max_inflight must be"),
        ({"writer_threads": 0}, "writer_threads must be"),
        ({"colour": "red"}, "unknown Checkpointer option"),
    ],
)
def test_bad_arguments_fail_fast_and_create_nothing(
    tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    target = tmp_path / "never"
    with pytest.raises(ConfigError, match=message):
        Checkpointer(target, **kwargs)  # type: ignore[arg-type]
    assert not target.exists()


def test_bad_save_input(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(ConfigError, match="step must be"):
            ckpt.save({"w": torch.zeros(1)}, step=-1)
        with pytest.raises(ConfigError, match="fn holds a builtin_function_or_method"):
            ckpt.save({"fn": print}, step=1)
        with pytest.raises(ConfigError, match="state must be a dict"):
            ckpt.save([torch.zeros(1)], step=1)  # type: ignore[arg-type]
        assert ckpt.steps() == []


def test_unwritable_targets_fail_at_construction(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(CheckpointError, match="is not writable"):
        Checkpointer(a_file)
    with pytest.raises(CheckpointError, match="is not writable"):
        Checkpointer(a_file / "sub")


def test_closed_checkpointer_refuses_work(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path)
    ckpt.close()
    with pytest.raises(CheckpointError, match="closed"):
        ckpt.save({"w": torch.zeros(1)}, step=1)


def test_unpicklable_metadata_globals_are_refused(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ckpt:
        path = Path(ckpt.save({"w": torch.zeros(1)}, step=1).wait().path)
    from nbckpt._dcp import load_metadata

    with open(path / ".metadata", "rb") as stream:
        assert "w" in load_metadata(stream, "ok").state_dict_metadata
    import io
    import pickle

    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.system, ("true",))

    with pytest.raises(CheckpointError, match="refusing to load global"):
        load_metadata(io.BytesIO(pickle.dumps(Evil())), "evil")


def test_no_warnings_on_a_clean_run(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Checkpointer(tmp_path, keep=1) as ckpt:
            ckpt.save({"w": torch.zeros(3)}, step=1)
            ckpt.save({"w": torch.zeros(3)}, step=2)
            ckpt.restore({"w": torch.zeros(3)})
    assert not [w for w in caught if "nbckpt" in str(w.message)]


def test_blocking_save_in_async_mode_commits_before_returning(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, mode="async") as ckpt:
        first = ckpt.save({"w": torch.zeros(1000)}, step=1)
        second = ckpt.save({"w": torch.ones(1000)}, step=2, blocking=True)
        assert first.done() and second.done() and ckpt.steps() == [1, 2]
        assert second.wait().stall_s >= second.wait().persist_s


def test_config_object_is_honoured_and_arguments_override_it(tmp_path: Path) -> None:
    from nbckpt import CheckpointConfig

    config = CheckpointConfig(mode="sync", keep=3, writer_threads=1)
    with Checkpointer(tmp_path / "a", config=config) as ckpt:
        assert (ckpt.config.mode, ckpt.config.keep, ckpt.config.writer_threads) == ("sync", 3, 1)
    with Checkpointer(tmp_path / "b", "async", None, config=config, max_inflight=2) as ckpt:
        assert (ckpt.config.mode, ckpt.config.keep, ckpt.config.max_inflight) == ("async", None, 2)


def test_a_failing_timeline_listener_never_breaks_a_save(tmp_path: Path) -> None:
    def broken(event: object) -> None:
        raise RuntimeError("listener bug")

    with Checkpointer(tmp_path) as ckpt:
        ckpt.timeline.add_listener(broken)
        with pytest.warns(UserWarning, match="listener"):
            record = ckpt.save({"w": torch.zeros(3)}, step=1).wait()
        assert record.step == 1 and ckpt.steps() == [1]


def test_resaving_a_step_swaps_it_without_a_window(tmp_path: Path) -> None:
    from nbckpt._store import _exchange

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    if not _exchange(str(a), str(b)):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not supported here")
    assert (b / "x").read_text() == "a" and not (a / "x").exists()
