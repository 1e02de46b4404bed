"""The rows an exchange between ranks sends in its one all-gather (``_ranks.pack_row``): what
fits arrives whole, and a payload larger than the row is told to every rank by its length, so
that all of them send again at the same larger size (the collective itself is exercised by every
multi-rank test)."""

from __future__ import annotations

import pickle

import pytest

from nbckpt.engine._ranks import SLOT_BYTES, pack_row, unpack_rows


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
