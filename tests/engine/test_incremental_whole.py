"""Incremental saves (issue 32), "every step stays whole" beyond ``ckpt.delete``: a step whose files
are shared with earlier steps is exported by ``nbckpt export``, survives the Browser's delete and a
mirror's retention, stays whole where the file system refuses hard links (and its SaveRecord says
what was written), and on S3 the shared files' bytes never pass through the client (counted by a
proxy in front of the real server)."""

from __future__ import annotations

import contextlib
import errno
import shutil
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.finetune import setup, snapshot, tune
from helpers.s3server import SeaweedS3

from nbckpt import Checkpointer, cli
from nbckpt.engine._faults import armed
from nbckpt.notebook import Browser


def run_steps(ckpt: Checkpointer, steps: range, changed_at: int | None = None) -> dict[int, dict[str, Any]]:
    """The adapter fine-tune saved at each of ``steps`` (its frozen base changed once, at
    ``changed_at``): step -> every tensor as saved."""
    model, optim, state = setup()
    expected = {}
    for step in range(1, max(steps) + 1):
        tune(model, optim, step)
        if step == changed_at:
            with torch.no_grad():
                model.base[0].weight.mul_(2)
        state["step"] = step
        if step in steps:
            ckpt.save(state, step=step).wait()
            expected[step] = snapshot(state)
    return expected


def nested(flat: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Dotted keys as nested dicts: DCP flattens them back to the same keys."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def assert_whole(directory: Path, step: int, expected: dict[str, torch.Tensor]) -> None:
    """Step ``step`` of the run (or mirror) at ``directory`` verifies, restores bit-exactly, and a
    plain ``dcp.load`` reads every tensor of it, the optimizer's state included."""
    with Checkpointer(directory, read_only=True) as ckpt:
        ckpt.verify(step)
        model, optim, state = setup(seed=99)
        tune(model, optim, 0)  # the optimizer has state to load into
        assert ckpt.restore(state, step=step) == step
    assert_same(snapshot(state), expected)
    target = {key: torch.zeros_like(value) for key, value in expected.items()}
    dcp.load(nested(target), checkpoint_id=str(directory / f"step-{step:06d}"))
    assert_same(target, expected)


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def links(step_dir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_nlink for p in step_dir.iterdir() if p.name != "manifest.json"}


def test_nbckpt_export_of_a_step_whose_earlier_steps_are_deleted(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with Checkpointer(run, mode="sync", incremental=True) as ckpt:
        expected = run_steps(ckpt, range(1, 5))
        assert max(links(run / "step-000004").values()) == 4  # the base's files, written at step 1
        for step in (1, 2, 3):
            ckpt.delete(step)
    out = tmp_path / "model.pt"
    assert cli.main(["export", str(run / "step-000004"), str(out)]) == 0
    plain = torch.load(out, weights_only=True)
    got = {f"model.{k}": v for k, v in plain["model"].items()}
    for index, values in plain["optim"]["state"].items():
        got.update({f"optim.state.{index}.{k}": v for k, v in values.items()})
    assert_same(got, expected[4])
    assert plain["step"] == 4


def test_the_browsers_delete_never_breaks_a_retained_step(tmp_path: Path) -> None:
    """Deleted through the notebook's Browser: with no writer open (it opens its own), then with
    the run's incremental Checkpointer open in the kernel (the delete goes through it) and its
    newest step deleted, the one its next save would have shared files with."""
    run = tmp_path / "run"
    with Checkpointer(run, mode="sync", incremental=True) as ckpt:
        expected = run_steps(ckpt, range(1, 6), changed_at=3)
    browser = Browser(run)
    for gone in (1, 4):
        browser.select(gone)
        assert browser.delete() and browser.confirm_delete(), browser.error
        for step in (row.step for row in browser.rows):
            assert_whole(run, step, expected[step])
    assert [row.step for row in browser.rows] == [2, 3, 5]
    model, optim, state = setup()
    with Checkpointer(run, mode="sync", incremental=True) as ckpt:
        ckpt.restore(state)
        for step in (6, 7, 8):
            tune(model, optim, step)
            state["step"] = step
            ckpt.save(state, step=step).wait()  # 7 shares nothing with 6: the Browser deleted it
            expected[step] = snapshot(state)
            if step == 6:
                browser.refresh()
                browser.select(6)
                assert browser.delete() and browser.confirm_delete(), browser.error
                assert ckpt.steps() == [2, 3, 5]
    assert max(links(run / "step-000007").values()) == 2  # the base's files, written at step 7
    assert [row.step for row in browser.rows] == [2, 3, 5]
    browser.refresh()
    assert [row.step for row in browser.rows] == [2, 3, 5, 7, 8]
    for step in (2, 3, 5, 7, 8):
        assert_whole(run, step, expected[step])


def test_a_step_deleted_behind_the_checkpointers_back_is_shared_from_by_no_save(tmp_path: Path) -> None:
    """The newest step removed by another process (a user's ``rm -r``; a rank that alone deleted
    it): the next save, which would have shared its base's files, writes every file and commits
    (it failed on the files gone), and the one after shares again."""
    run = tmp_path / "run"
    with Checkpointer(run, mode="sync", incremental=True) as ckpt:
        expected = run_steps(ckpt, range(1, 3))
        shutil.rmtree(run / "step-000002")
        model, optim, state = setup()
        for step in (1, 2, 3, 4):
            tune(model, optim, step)
        records = []
        for step in (3, 4):
            state["step"] = step
            records.append(ckpt.save(state, step=step).wait())
            expected[step] = snapshot(state)
        assert records[0].bytes_skipped == 0 and records[1].bytes_skipped > 0, records
        assert ckpt.steps() == [1, 3, 4]
    for step in (1, 3, 4):
        assert_whole(run, step, expected[step])


def test_a_mirrors_retention_never_breaks_a_retained_step(tmp_path: Path) -> None:
    """keep=2 deletes old steps in the run's directory and on the mirror (each step's files there
    its own copies): both keep whole steps, the mirror read as a run of its own."""
    run, mirror = tmp_path / "run", tmp_path / "mirror"
    with Checkpointer(run, mode="sync", incremental=True, keep=2, mirror=str(mirror)) as ckpt:
        expected = run_steps(ckpt, range(1, 7), changed_at=4)
        ckpt.wait()
        ckpt.retain()  # a step whose upload was still reading it when a pass ran goes now
        ckpt.wait()
        assert ckpt.steps() == [5, 6]
        assert max(links(run / "step-000006").values()) == 2  # steps 5 and 6 share the base's files
    with Checkpointer(mirror, read_only=True) as copy:
        assert copy.steps() == [5, 6]
    for directory in (run, mirror):
        for step in (5, 6):
            assert_whole(directory, step, expected[step])


def test_where_links_are_refused_the_copy_keeps_every_step_whole(tmp_path: Path) -> None:
    """A file system that refuses some hard links (FAT refuses all; ext4 past 65,000 links to one
    inode): each refused file is copied from the step before, and SaveRecord counts it written."""
    refused = []

    def refuse_every_other(source: str, location: str, name: str) -> None:
        refused.append(name)
        if len(refused) % 2:
            raise OSError(errno.EPERM, "Operation not permitted")

    run = tmp_path / "run"
    expected = {}
    with armed("store.share", refuse_every_other), Checkpointer(run, mode="sync", incremental=True) as ckpt:
        model, optim, state = setup()
        for step in range(1, 5):
            tune(model, optim, step)
            state["step"] = step
            record = ckpt.save(state, step=step).wait()
            expected[step] = snapshot(state)
            sizes = {
                p.name: p.stat() for p in (run / f"step-{step:06d}").iterdir() if p.name != "manifest.json"
            }
            before = (
                {p.stat().st_ino for p in (run / f"step-{step - 1:06d}").glob("*")} if step > 1 else set()
            )
            linked = sum(s.st_size for s in sizes.values() if s.st_ino in before)
            assert record.bytes_skipped == linked
            assert record.bytes_written == sum(s.st_size for s in sizes.values()) - linked
            if step > 1:  # the base's two files: one linked, one copied
                assert 0 < linked < record.bytes_written
        assert len(refused) == 6
        for gone in (1, 2, 3):
            ckpt.delete(gone)
            for step in ckpt.steps():
                assert_whole(run, step, expected[step])


class CountingProxy:
    """A TCP proxy on loopback in front of ``port``, counting the bytes that pass each way."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.sent = self.received = 0  # client -> server, server -> client
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            self._sockets += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        with contextlib.suppress(OSError):  # either side closed: the connection is over
            while data := src.recv(1 << 16):
                with self._lock:
                    if up:
                        self.sent += len(data)
                    else:
                        self.received += len(data)
                dst.sendall(data)
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return self.sent, self.received

    def close(self) -> None:
        self._listener.close()
        for sock in self._sockets:
            sock.close()


@pytest.fixture
def proxy(s3_server: SeaweedS3) -> Iterator[CountingProxy]:
    counting = CountingProxy(s3_server.ports["s3.port"])
    yield counting
    counting.close()


@pytest.mark.s3
@pytest.mark.xdist_group("s3")
def test_s3_shares_files_by_server_side_copy_counted_at_the_wire(
    s3_server: SeaweedS3, proxy: CountingProxy
) -> None:
    """The bytes between nbckpt and the server, counted by a proxy the test controls: a save
    after the first sends and receives far less than the files it shares (a copy through the
    client would download and upload each of them), and the first sends them all."""
    bucket = f"wire-{uuid.uuid4().hex[:10]}"
    s3_server.make_bucket(bucket)
    options = s3_server.storage_options(endpoint_url=f"http://127.0.0.1:{proxy.port}")
    model, optim, state = setup()
    base = sum(p.nbytes for p in model.base.parameters())
    with Checkpointer(f"s3://{bucket}/run", mode="sync", incremental=True, storage_options=options) as ckpt:  # type: ignore[arg-type]
        for step in (1, 2, 3):
            tune(model, optim, step)
            state["step"] = step
            sent, received = proxy.counts()
            record = ckpt.save(state, step=step).wait()
            sent, received = proxy.counts()[0] - sent, proxy.counts()[1] - received
            assert sent >= record.bytes_written  # every byte written passes the proxy
            if step == 1:
                assert sent > base
            else:
                assert record.bytes_skipped > base
                assert sent < record.bytes_written + record.bytes_skipped / 4, (sent, record)
                assert received < record.bytes_skipped / 4, (received, record)
        expected = snapshot(state)
        ckpt.delete(1)
        ckpt.delete(2)
        fresh_model, fresh_optim, fresh = setup(seed=5)
        tune(fresh_model, fresh_optim, 0)
        assert ckpt.restore(fresh) == 3
    assert_same(snapshot(fresh), expected)
