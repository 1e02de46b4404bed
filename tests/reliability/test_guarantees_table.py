"""docs/reliability.md maps every guarantee to the test that asserts it: each test it names exists."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).parents[1]
TABLE = TESTS.parent / "docs" / "reliability.md"


def named_tests() -> list[tuple[str, str, str | None]]:
    """(row, file, test name or None for a whole file) for every test the table names."""
    named = []
    for row in TABLE.read_text().splitlines():
        if not row.startswith("| ") or row.startswith(("| guarantee", "|---")):
            continue
        cell = row.rstrip(" |").rsplit(" | ", 1)[-1]
        current: str | None = None
        for token in re.findall(r"`([^`]+)`", cell):
            if ".py" not in token and not token.startswith("::"):
                continue  # an option such as `--slow`
            path, _, name = token.partition("::")
            if path:
                current = path
            assert current is not None, f"{token} names no file: {row[:80]}"
            named.append((row[:80], current, name or None))
    return named


def test_every_test_the_guarantees_table_names_exists() -> None:
    named = named_tests()
    assert len(named) > 40
    missing = []
    for row, path, name in named:
        source = TESTS / path
        if not source.is_file():
            missing.append(f"{path} (row {row!r})")
            continue
        if name is None:
            continue
        pattern = re.escape(name.rstrip("*")) + (r"\w*" if name.endswith("*") else r"\b")
        if not re.search(rf"^def {pattern}\(", source.read_text(), re.MULTILINE):
            missing.append(f"{path}::{name} (row {row!r})")
    assert missing == [], "\n".join(missing)
