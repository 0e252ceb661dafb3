"""The outbox's journal: records put before a crash (a journal never absorbed, one
left half-absorbed, or one taken for the ledger and not yet settled) are all there
after a restart, in order and once each; a torn line is skipped without losing its
neighbours; a short write (full disk) is cut off so the next record stays readable;
settled records are gone, kept ones queue in the database."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from proxy import outbox as outbox_module
from proxy.outbox import ABSORBING_SUFFIX, JOURNAL_FILE, TAKEN_SUFFIX, Outbox


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


def test_taken_records_survive_a_crash_before_they_are_settled(tmp_path: Path) -> None:
    """kill -9 between taking the journal and the ledger commit loses nothing."""
    outbox = Outbox.in_dir(tmp_path)
    outbox.put("a", {"n": 1})
    outbox.put("b", {"n": 2})
    outbox.put("a", {"n": 3})  # a repeat: the first is kept
    assert outbox.take_fresh() == [("a", {"n": 1}), ("b", {"n": 2})]
    assert outbox.depth() == 2  # taken, not settled: still waiting
    with pytest.raises(RuntimeError):
        outbox.take_fresh()  # one take at a time
    outbox.put("c", {"n": 4})  # into the new journal
    _crash(outbox)
    reopened = Outbox.in_dir(tmp_path)
    assert reopened.peek() == [("a", {"n": 1}), ("b", {"n": 2}), ("c", {"n": 4})]
    assert not (tmp_path / (JOURNAL_FILE + TAKEN_SUFFIX)).exists()
    reopened.close()


def test_settled_records_are_gone_and_kept_ones_queue_in_order(tmp_path: Path) -> None:
    outbox = Outbox.in_dir(tmp_path)
    outbox.put("a", {"n": 1})
    assert not outbox.backlog()
    assert outbox.take_fresh() == [("a", {"n": 1})]
    outbox.settle_taken()
    assert (outbox.depth(), outbox.take_fresh(), outbox.peek()) == (0, [], [])
    outbox.put("b", {"n": 2})
    assert outbox.take_fresh() == [("b", {"n": 2})]
    outbox.put("c", {"n": 3})
    outbox.keep_taken()  # the ledger write failed
    assert outbox.backlog()
    assert outbox.peek() == [("b", {"n": 2}), ("c", {"n": 3})]
    outbox.remove(["b", "c"])
    assert not outbox.backlog() and outbox.depth() == 0
    outbox.close()


def test_outbox_files_are_owner_only(tmp_path: Path) -> None:
    box = Outbox.in_dir(tmp_path)
    box.put("r1", {"n": 1})
    box.close()
    box = Outbox.in_dir(tmp_path)  # absorbed into the database, journal reopened
    box.put("r2", {"n": 2})
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in tmp_path.iterdir()}
    box.close()
    assert set(modes.values()) == {"0o600"}, modes
    assert "outbox.sqlite3" in modes and JOURNAL_FILE in modes
