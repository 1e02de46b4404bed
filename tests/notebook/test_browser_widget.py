"""The checkpoint browser without a browser: real runs on disk (and on the SeaweedFS S3 server),
buttons clicked from Python, every refusal one line (tests/notebook/test_browser.py drives it
in a real JupyterLab)."""

from __future__ import annotations

import html
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.faults import armed
from helpers.s3server import SeaweedS3

from nbckpt import Checkpointer
from nbckpt.notebook import Browser
from nbckpt.notebook._browser_index import saved_values


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    optim.zero_grad()
    model(torch.randn(8, 6)).pow(2).mean().backward()
    optim.step()


def state(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model, "optim": optim, "step": step, "args": {"lr": 0.05, "name": "tiny"}}


def saved_run(directory: Path | str, steps: tuple[int, ...] = (1, 2, 3), **options: Any) -> torch.nn.Module:
    """A run whose steps each follow a real optimizer step; returns the model as of the last."""
    model, optim = trained()
    with Checkpointer(directory, mode="sync", **options) as ckpt:
        for step in steps:
            train_step(model, optim)
            ckpt.save(state(model, optim, step), step=step)
    return model


def one_line_error(browser: Browser) -> str:
    assert browser.error is not None and "\n" not in browser.error
    assert "nbckpt-error" in browser.message.value and "Traceback" not in browser.message.value
    return browser.error


def cells(browser: Browser) -> dict[str, list[str]]:
    return {row["id"]: row["cells"] for row in browser.table.rows}


def test_the_table_shows_the_run_and_its_set_aside_steps_with_values_and_provenance(tmp_path: Path) -> None:
    model, optim = trained()
    with Checkpointer(tmp_path / "run", mode="sync") as ckpt:
        for step in (10, 20, 30):
            train_step(model, optim)
            ckpt.save(state(model, optim, step), step=step)
        ckpt.restore({"model": model, "optim": optim}, step=20)
        with pytest.warns(UserWarning, match="set-aside-1"):
            ckpt.save(state(model, optim, 25), step=25)
    browser = Browser(tmp_path / "run")
    assert [row.key for row in browser.rows] == [("", 10), ("", 20), ("", 25), ("set-aside-1", 30)]
    row = browser.rows[1]
    assert row.values == {"step": 20, "args.lr": 0.05, "args.name": "tiny"}
    assert row.provenance["torch"] == torch.__version__ and row.provenance["host"]
    assert row.nbytes and row.nbytes > 0 and row.tensors == 4 + 4 * 2 + 4  # weights, Adam's moments
    assert row.stage_s is not None and row.write_s is not None and row.write_s >= 0
    shown = cells(browser)
    assert shown["set-aside-1:30"][:2] == ["set-aside-1 (set aside after step 20)", "30"]
    assert shown["20"][:2] == ["this run", "20"]
    assert shown["20"][6] == "not checked"
    assert shown["20"][7] == "step=20, args.lr=0.05, args.name='tiny'"
    assert f"torch {torch.__version__}" in shown["20"][8]
    assert "4 step(s), 1 run(s) set aside in it" in browser.title.value
    with pytest.raises(ValueError, match=r"no committed step 99"):
        browser.select(99)
    with pytest.raises(ValueError, match=r"no committed step 30; it has 10, 20, 25, set-aside-1:30"):
        browser.select(30)  # a bare number is a step of the run itself, never one set aside
    browser.select(("set-aside-1", 30))
    assert browser.selected == [("set-aside-1", 30)]
    # the Browser restores a step set aside, bit for bit, from where it is now
    fresh_model, fresh_optim = trained()
    assert browser.restore({"model": fresh_model, "optim": fresh_optim}) == 30
    assert "Restored set-aside-1 step 30" in browser.message.value
    with Checkpointer(tmp_path / "run" / "set-aside-1", read_only=True) as reader:
        saved = reader.load(30)["model"]
    assert all(torch.equal(saved[k], v) for k, v in fresh_model.state_dict().items())


def test_saved_values_leave_modules_and_optimizers_out() -> None:
    model, optim = trained()
    train_step(model, optim)  # an optimizer's state holds tensors once it has stepped
    fresh = torch.optim.SGD(model.parameters(), lr=0.1)  # no tensor in its state, still left out
    values = saved_values(
        {
            "model": model.state_dict(),
            "optim": optim.state_dict(),
            "epoch": 3,
            "sgd": fresh.state_dict(),
            "cfg": {"sizes": [1, 2], "inner": {"on": True}},
            "w": torch.zeros(2),
        }
    )
    assert values == {"epoch": 3, "cfg.sizes": [1, 2], "cfg.inner.on": True}


def test_verify_marks_a_damaged_step_as_damaged(tmp_path: Path) -> None:
    saved_run(tmp_path / "run")
    data = next((tmp_path / "run" / "step-000002").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    browser = Browser(tmp_path / "run")
    browser.select(2)
    assert browser.verify() == [("", 2)]
    state_cell = cells(browser)["2"][6]
    assert state_cell.startswith("damaged: step-000002/__0_0.distcp is corrupt")
    assert "Damaged: step 2" in html.unescape(browser.message.value)
    browser.select()
    browser.verify_button.click()  # nothing selected: every step
    verdicts = {row["id"]: (row["cells"][6].split(":")[0], row["tone"]) for row in browser.table.rows}
    assert verdicts == {
        "1": ("verified", "verified"),
        "2": ("damaged", "damaged"),
        "3": ("verified", "verified"),
    }


def test_a_step_whose_manifest_is_damaged_shows_why(tmp_path: Path) -> None:
    saved_run(tmp_path / "run", steps=(1, 2))
    manifest = tmp_path / "run" / "step-000001" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"step":1', b'"step":7'))
    browser = Browser(tmp_path / "run")
    damaged, intact = browser.rows
    assert damaged.problem == (
        "step-000001/manifest.json was modified after it was written (checksum mismatch)"
    )
    assert intact.problem is None and intact.values["step"] == 2
    row = next(r for r in browser.table.rows if r["id"] == "1")
    assert row["tone"] == "damaged" and row["cells"][6] == f"damaged: {damaged.problem}"


def test_diff_of_two_steps_after_a_real_optimizer_step(tmp_path: Path) -> None:
    model, optim = trained()
    with Checkpointer(tmp_path / "run", mode="sync") as ckpt:
        train_step(model, optim)
        ckpt.save(state(model, optim, 1), step=1)
        first = {k: t.detach().double().clone() for k, t in model.state_dict().items()}
        train_step(model, optim)
        ckpt.save(state(model, optim, 2), step=2)
    browser = Browser(tmp_path / "run")
    assert browser.diff_button.disabled
    browser.select(2, 1)
    assert not browser.diff_button.disabled
    browser.diff_button.click()
    assert browser.error is None
    frame = browser.diff_frame
    assert frame is not None
    rows = {row["key"]: row for row in frame.to_dict(orient="records")}
    for name, tensor in model.state_dict().items():
        moved = tensor.detach().double() - first[name]
        assert rows[f"model.{name}"]["status"] == "changed"
        assert rows[f"model.{name}"]["diff_norm"] == pytest.approx(float(moved.norm()), rel=1e-9)
        assert rows[f"model.{name}"]["max_abs_diff"] == pytest.approx(float(moved.abs().max()), rel=1e-9)
    assert rows["optim.state.0.exp_avg"]["status"] == "changed"
    assert rows["optim.state.0.step"]["max_abs_diff"] == 1.0
    shown = [row["id"] for row in browser.diff_table.rows]
    assert shown == list(frame["key"])  # most changed first, as the frame
    summary = html.unescape(browser.diff_header.value)
    assert "step 1 → step 2: 16 tensors (16 changed)" in summary  # the earlier one is a


def test_delete_asks_first_then_deletes_and_refresh_shows_it_gone(tmp_path: Path) -> None:
    saved_run(tmp_path / "run")
    browser = Browser(tmp_path / "run")
    browser.select(1)
    browser.delete_button.click()
    assert browser.confirm_button.layout.display == ""
    assert (tmp_path / "run" / "step-000001").exists()  # nothing yet
    browser.confirm_button.click()
    assert browser.error is None and "Deleted step 1." in browser.message.value
    assert [row.step for row in browser.rows] == [2, 3] and browser.selected == []
    assert not (tmp_path / "run" / "step-000001").exists()
    assert browser.confirm_button.layout.display == "none"
    # a step saved meanwhile appears on refresh
    model, optim = trained()
    with Checkpointer(tmp_path / "run", mode="sync") as ckpt:
        ckpt.save(state(model, optim, 4), step=4)
    assert browser.refresh()
    assert [row.step for row in browser.rows] == [2, 3, 4]


def test_refusals_are_one_line_and_delete_nothing(tmp_path: Path) -> None:
    saved_run(tmp_path / "run", steps=(1, 2))
    browser = Browser(tmp_path / "run")
    # the run's own Checkpointer is open for writing in this kernel: the delete goes through it
    browser.select(2)
    with Checkpointer(tmp_path / "run") as ckpt:
        assert browser.delete() and browser.confirm_delete(), browser.error
        assert ckpt.steps() == [1] and not ckpt.closed
    assert [row.step for row in browser.rows] == [1]
    assert not browser.confirm_delete()
    assert one_line_error(browser).startswith("Cannot delete: no delete to confirm")
    saved_run(tmp_path / "run", steps=(2,))
    browser.refresh()
    browser.select(1, 2)
    assert browser.delete_button.disabled and not browser.delete()
    assert one_line_error(browser) == "Cannot delete: select the one step to delete, not 2"


def test_a_step_set_aside_can_be_deleted_from_its_run(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "run") as ckpt:
        for step in (1, 2):
            ckpt.save({"w": torch.full((3,), float(step))}, step=step)
        ckpt.restore({"w": torch.zeros(3)}, step=1)
        with pytest.warns(UserWarning, match="set-aside-1"):
            ckpt.save({"w": torch.full((3,), 5.0)}, step=5).wait()
    browser = Browser(tmp_path / "run")
    browser.select(("set-aside-1", 2))
    assert browser.delete() and browser.confirm_delete()
    assert [row.key for row in browser.rows] == [("", 1), ("", 5)]


def test_errors_inside_an_action_are_one_line(tmp_path: Path) -> None:
    missing = Browser(tmp_path / "nowhere")
    assert missing.rows == [] and missing.error is None
    assert "does not exist" in missing.message.value
    saved_run(tmp_path / "run", steps=(1, 2))
    browser = Browser(tmp_path / "run")
    browser.select(1)
    assert browser.diff() is None
    assert one_line_error(browser) == "Cannot diff: select two steps to compare, not 1"

    def broken(url: str) -> None:  # the diff's reader lists the run
        raise RuntimeError("boom\nsecond line")

    browser.select(1, 2)
    with armed("store.names", broken):
        assert browser.diff() is None
    assert one_line_error(browser) == "Cannot diff: unexpected RuntimeError: boom; second line"
    assert not browser.diff_button.disabled  # not left busy


def test_a_new_browser_of_the_same_run_closes_the_previous_one(tmp_path: Path) -> None:
    saved_run(tmp_path / "run", steps=(1,))
    first = Browser(tmp_path / "run")
    other = Browser(tmp_path / "other")
    second = Browser(str(tmp_path / "run") + "/")  # the same run, spelt differently
    assert first.closed and not second.closed and not other.closed
    assert first.widget.comm is None and second.widget.comm is not None
    assert not first.refresh() and "closed" in (first.error or "")
    assert "closed nbckpt Browser" in first._repr_mimebundle_()["text/plain"]
    second.close()
    other.close()


@pytest.fixture
def bucket(s3_server: SeaweedS3) -> str:
    name = f"nbckpt-{uuid.uuid4().hex[:10]}"
    s3_server.make_bucket(name)
    return name


@pytest.mark.s3
@pytest.mark.xdist_group("s3")
def test_browsing_a_run_on_s3(s3_server: SeaweedS3, bucket: str) -> None:
    url = f"s3://{bucket}/run"
    options = s3_server.storage_options()
    saved_run(url, steps=(1, 2), storage_options=options)
    browser = Browser(url, storage_options=options)
    assert [row.step for row in browser.rows] == [1, 2] and browser.error is None
    assert browser.rows[0].values["args.lr"] == 0.05
    assert browser.verify() == []
    browser.select(1, 2)
    frame = browser.diff()
    assert frame is not None and set(frame["status"]) == {"changed"}
    browser.select(1)
    assert browser.delete()
    assert "object store" in browser.message.value  # the confirmation says what it risks
    assert browser.confirm_delete(), browser.error
    assert [row.step for row in browser.rows] == [2]
    objects = s3_server.filesystem().find(f"{bucket}/run")
    assert objects and not [key for key in objects if "/step-000001/" in key]
    wrong = Browser(url, storage_options=s3_server.storage_options(secret="not-the-secret"))
    assert wrong.rows == []
    assert one_line_error(wrong).startswith("Cannot read the run: ")


def test_actions_from_two_threads_run_one_at_a_time(tmp_path: Path) -> None:
    saved_run(tmp_path / "run", steps=(1, 2))
    browser = Browser(tmp_path / "run")
    browser.select(1, 2)
    inside, release = threading.Event(), threading.Event()

    def held(url: str) -> None:  # the verify's reader lists the run: held there
        inside.set()
        assert release.wait(60)

    verified: list[Any] = []
    worker = threading.Thread(target=lambda: verified.append(browser.verify()))
    with armed("store.names", held):
        worker.start()
        assert inside.wait(60)
        try:
            assert browser.diff() is None  # refused while the verify holds the browser
            assert one_line_error(browser) == "Cannot diff: another action is still running"
        finally:
            release.set()
            worker.join()
    assert verified == [[]]  # the verify went on: no step damaged
    assert browser.diff() is not None  # the browser is free again
