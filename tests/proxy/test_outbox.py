"""The outbox's journal: records put before a crash (a journal never absorbed, or one
left half-absorbed) are all there after a restart, in order and once each; a torn
line is skipped without losing its neighbours; a short write (full disk) is cut off
so the next record stays readable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from proxy import outbox as outbox_module
from proxy.outbox import ABSORBING_SUFFIX, JOURNAL_FILE, Outbox


def _crash(outbox: Outbox) -> None:
    """What kill -9 leaves: the journal file as written, nothing absorbed or closed."""
    os.close(outbox._fd)  # only to not leak the descriptor in the test process


def test_journal_survives_a_crash_and_is_absorbed_in_order(tmp_path: Path) -> None:
    first = Outbox.in_dir(tmp_path)
    first.put("a", {"n": 1})
    first.put("b", {"n": 2})
    _crash(first)
    journal = tmp_path / JOURNAL_FILE
    # a crash while absorbing: the renamed journal is still there, and a newer journal
    os.replace(journal, tmp_path / (JOURNAL_FILE + ABSORBING_SUFFIX))
    second = Outbox.in_dir(tmp_path)
    second.put("c", {"n": 3})
    second.put("a", {"n": 4})  # a repeat of a queued id: the first is kept
    _crash(second)
    third = Outbox.in_dir(tmp_path)
    assert third.peek() == [("a", {"n": 1}), ("b", {"n": 2}), ("c", {"n": 3})]
    assert third.depth() == 3
    assert not (tmp_path / (JOURNAL_FILE + ABSORBING_SUFFIX)).exists()
    third.close()


def test_torn_line_is_skipped_and_the_rest_kept(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    outbox = Outbox.in_dir(tmp_path)
    outbox.put("a", {"n": 1})
    _crash(outbox)
    with (tmp_path / JOURNAL_FILE).open("ab") as journal:
        journal.write(b'["b",{"n":')  # power loss in the middle of a line
    reopened = Outbox.in_dir(tmp_path)
    reopened.put("c", {"n": 3})
    assert [rid for rid, _ in reopened.peek()] == ["a", "c"]
    assert "unreadable line skipped" in caplog.text
    reopened.close()


def test_short_write_is_cut_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outbox = Outbox.in_dir(tmp_path)
    outbox.put("a", {"n": 1})
    real_write = os.write

    def half_write(fd: int, data: bytes) -> int:
        return real_write(fd, data[: len(data) // 2])

    monkeypatch.setattr(outbox_module.os, "write", half_write)
    with pytest.raises(OSError, match="short write"):
        outbox.put("b", {"n": 2})
    monkeypatch.setattr(outbox_module.os, "write", real_write)
    outbox.put("c", {"n": 3})
    assert outbox.peek() == [("a", {"n": 1}), ("c", {"n": 3})]
    outbox.close()
