"""The progress journal of streams (crash-safe metering): what a stream delivered is
on disk at least every N tokens or M seconds, a restart recovers only the streams that
never finished, once; a torn line is skipped; the file is the owner's only."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from proxy.progress import PROGRESS_FILE, ProgressJournal


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_due_every_n_tokens_or_m_seconds(tmp_path: Path) -> None:
    clock = Clock()
    journal = ProgressJournal.in_dir(tmp_path, every_tokens=4, every_s=0.5, clock=clock)
    assert journal.due(1, 0, 0.0)  # the first token: at once
    assert not journal.due(3, 1, clock.now)
    assert journal.due(5, 1, clock.now)  # 4 more tokens
    clock.now += 0.5
    assert journal.due(2, 1, clock.now - 0.5)  # 0.5 s since
    assert not journal.due(1, 1, 0.0)  # nothing new since


def test_restart_recovers_unfinished_streams_once(tmp_path: Path) -> None:
    journal = ProgressJournal.in_dir(tmp_path)
    journal.note("a", {"completion_tokens": 3})
    journal.note("b", {"completion_tokens": 1})
    journal.note("a", {"completion_tokens": 7})  # latest wins
    journal.note("c", {"completion_tokens": 2})
    journal.done("c")  # finished: its own row exists
    # a kill -9 here: nothing closed
    again = ProgressJournal.in_dir(tmp_path)
    assert sorted(again.recover()) == [("a", {"completion_tokens": 7}),
                                       ("b", {"completion_tokens": 1})]
    assert again.recover() == []
    again.forget_recovered()
    again.close()
    assert ProgressJournal.in_dir(tmp_path).recover() == []


def test_torn_line_is_skipped_and_file_is_owner_only(tmp_path: Path) -> None:
    journal = ProgressJournal.in_dir(tmp_path)
    journal.note("a", {"completion_tokens": 3})
    journal.close()
    path = tmp_path / PROGRESS_FILE
    with path.open("ab") as f:
        f.write(b'["b", {"completion_')  # a power loss mid-line
    again = ProgressJournal.in_dir(tmp_path)
    assert again.recover() == [("a", {"completion_tokens": 3})]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again.note("c", {"completion_tokens": 1})  # starts on a line of its own
    again.close()
    assert [rid for rid, _ in ProgressJournal.in_dir(tmp_path).recover()] == ["a", "c"]


def test_compaction_keeps_live_streams_only(tmp_path: Path) -> None:
    journal = ProgressJournal.in_dir(tmp_path, compact_bytes=200)
    journal.note("live", {"completion_tokens": 1})
    for i in range(20):
        journal.note(f"done-{i}", {"completion_tokens": i})
        journal.done(f"done-{i}")
    assert (tmp_path / PROGRESS_FILE).stat().st_size < 200
    journal.close()
    assert ProgressJournal.in_dir(tmp_path).recover() == [("live", {"completion_tokens": 1})]


def test_bad_intervals_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        ProgressJournal.in_dir(tmp_path, every_tokens=0)


def test_a_refusing_disk_is_reported_not_raised(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    journal = ProgressJournal.in_dir(tmp_path)

    def full(fd: int, data: bytes) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    assert not journal.note("a", {"completion_tokens": 1})
    journal.done("a")  # nothing raised either
    monkeypatch.undo()
    assert journal.note("b", {"completion_tokens": 2})
