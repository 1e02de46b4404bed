"""What a save's persist sends between ranks: the rows an exchange sends in its one all-gather
(``_ranks.pack_row``): what fits arrives whole, and a payload larger than the row is told to
every rank by its length, so that all of them send again at the same larger size; the
location a rank starts writing in before it has heard rank 0's (``Store.opened``); and what the
"out of step" refusal says. The collectives themselves are exercised by every multi-rank test."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from nbckpt import CheckpointError
from nbckpt.engine._ranks import SLOT_BYTES, _check_tags, pack_row, unpack_rows
from nbckpt.engine._store import LocalStore


def _rows(*payloads: bytes, slot: int = SLOT_BYTES) -> list[bytes]:
    return [pack_row(payload, slot).numpy().tobytes() for payload in payloads]


@pytest.mark.parametrize("size", [0, 1, SLOT_BYTES - 8])
def test_a_payload_that_fits_its_row_arrives_exactly(size: int) -> None:
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    rows = _rows(payload, b"x")
    assert all(len(row) == SLOT_BYTES for row in rows)
    assert unpack_rows(rows) == ([payload, b"x"], 0)


def test_a_payload_larger_than_its_row_is_told_by_its_length_on_every_rank() -> None:
    large, larger = bytes(SLOT_BYTES - 7), bytes(3 * SLOT_BYTES)
    assert unpack_rows(_rows(b"small", large, larger)) == ([], len(larger))
    # sent again at the largest size, every rank's arrives
    sent = (("write", 3, 1), {"blocks": ["0" * 16] * 1000}, None)
    again = _rows(b"small", large, pickle.dumps(sent), slot=8 + len(larger))
    payloads, needed = unpack_rows(again)
    assert needed == 0 and payloads[:2] == [b"small", large] and pickle.loads(payloads[2]) == sent


def test_a_rank_writes_before_hearing_rank_0_only_in_the_directory_rank_0_began(tmp_path: Path) -> None:
    store, elsewhere = LocalStore(str(tmp_path / "run")), LocalStore(str(tmp_path / "other"))
    store.prepare()
    elsewhere.prepare()
    assert store.opened(7, "ab1") is None  # not begun: the rank waits to hear where
    location = store.begin(7, "ab1")
    assert store.opened(7, "ab1") == location and os.path.isdir(location)
    # a rank whose run directory is not the one rank 0 began in sees nothing, and waits
    assert elsewhere.opened(7, "ab1") is None and store.opened(7, "ab2") is None
    os.rmdir(location)
    os.symlink(tmp_path, location)  # only begin's own directory counts
    assert store.opened(7, "ab1") is None


def test_out_of_step_names_the_save_numbers_where_the_steps_agree() -> None:
    """Two ranks writing step 12, in saves of different numbers (a save's exchanges after its
    first are tagged with the number every rank took from rank 0): the steps alone read "write
    of step 12, write of step 12"; the numbers tell them apart. Where the steps differ, they are
    enough."""
    numbered = [(("write", 12, 5), None, None), (("write", 12, 4), None, None)]
    with pytest.raises(CheckpointError) as refused:
        _check_tags(("write", 12, 5), numbered)
    assert str(refused.value).startswith(
        "ranks are out of step (rank 0 is in write of step 12 (save number 5), "
        "rank 1 is in write of step 12 (save number 4)); "
    )
    attempts = [(("check", 3, 1), None, None), (("check", 3, 2), None, None)]
    with pytest.raises(CheckpointError, match=r"rank 1 is in check of step 3 \(attempt 2\)\)"):
        _check_tags(("check", 3, 1), attempts)
    steps = [(("save", 4, 4), None, None), (("save", 5, 4), None, None)]
    with pytest.raises(
        CheckpointError, match=r"\(rank 0 is in save of step 4, rank 1 is in save of step 5\)"
    ):
        _check_tags(("save", 4, 4), steps)
