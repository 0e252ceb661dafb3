"""The ledger writer in a process of its own, so that a batch write never runs on the
gateway's CPU time or holds its GIL.

Rating a batch and writing it through SQLAlchemy costs milliseconds of pure Python; in
a thread of the serving process it held the GIL in 5 ms slices and stalled every
request in flight once per batch (a spike train at the batch period). Here the
gateway's drainer (:class:`proxy.metering.Meter`, in a worker thread) hands the
outbox's records to a child process and blocks on its answer, which releases the GIL::

    gateway process                                 writer process (niced)
    Meter._drain_blocking (worker thread)
      outbox.take_fresh() / peek()
      ProcessLedgerSink.write(payloads) ─ frame ──► entry_from_json, LedgerWriter.write
                                        ◄─ frame ── {"ok": n} | {"invalid": msg} | {"error": msg}
      outbox.settle_taken() / remove()

Frames are a 4-byte big-endian length and a JSON document, over the child's stdin and
stdout; the first frame gives the database URL (never on the command line). The
outbox stays the only durable state and the gateway its only owner: records leave it
only after the child answered ``ok``, so a child that dies mid-batch (its answer never
comes: :class:`LedgerProcessError`, the batch stays in the outbox, a new child is
started for the next trip) at worst repeats a committed batch, which the ledger's
unique request id turns into a no-op. After ``MAX_DEATHS`` children in a row died
without answering (one cannot even start here), the batches go to the ``fallback`` sink
(the in-process writer) instead. The child exits when its stdin closes (the
gateway stopped or died); it runs in a session of its own so that a Ctrl-C meant for
the gateway does not kill it before the gateway's final drain.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from kvtoll import fastjson

if TYPE_CHECKING:
    from proxy.metering import LedgerSink

log = logging.getLogger(__name__)
_HEADER = struct.Struct(">I")
NICE_INCREMENT = 5  # the ledger may trail by a little; requests may not
MAX_DEATHS = 3  # children dying in a row before the fallback sink takes over


class LedgerProcessError(RuntimeError):
    """The writer process failed the batch (database error) or died; retry later."""


def _send(stream: IO[bytes], document: Any) -> None:
    data = fastjson.dumps(document)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    """The next frame's document; None at end of stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        return None
    return fastjson.loads(data)


def shareable_url(factory: Any) -> str | None:
    """The database URL behind a ``sessionmaker`` that another process can open, with
    its password; None for an in-memory SQLite database or a factory without an engine
    (then the ledger is written in-process)."""
    bind = getattr(factory, "kw", {}).get("bind")
    url = getattr(bind, "url", None)
    if url is None:
        return None
    if url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:"):
        return None
    if url.get_backend_name() == "sqlite" and "mode=memory" in str(url):
        return None
    return str(url.render_as_string(hide_password=False))


class ProcessLedgerSink:
    """:class:`proxy.metering.LedgerSink` that writes through a child process (see the
    module doc). Thread-safe; one batch in flight at a time."""

    def __init__(self, database_url: str, fallback: LedgerSink | None = None) -> None:
        self._url = database_url
        self._fallback = fallback
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._num_deaths = 0  # children in a row that died without answering

    def open(self) -> None:
        """Start the child now (else it starts at the first write)."""
        with self._lock:
            self._ensure_started()

    def _ensure_started(self) -> subprocess.Popen[bytes]:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            return proc
        root = str(Path(__file__).resolve().parents[1])  # so the child finds our packages
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy.ledger_process"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env, start_new_session=True,
        )
        assert proc.stdin is not None
        _send(proc.stdin, {"database_url": self._url})
        self._proc = proc
        return proc

    @property
    def pid(self) -> int | None:
        """The child's process id while it runs."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def write(self, payloads: list[dict[str, Any]]) -> int:
        """Write the records (``entry_to_json`` dicts) in one ledger transaction; returns
        how many were new. Raises ``ValueError`` if the ledger refuses an entry as
        invalid, :class:`LedgerProcessError` if the database failed or the child died."""
        with self._lock:
            if self._fallback is not None and self._num_deaths >= MAX_DEATHS:
                return self._fallback.write(payloads)
            try:
                proc = self._ensure_started()
                assert proc.stdin is not None and proc.stdout is not None
                _send(proc.stdin, payloads)
                answer = _receive(proc.stdout)
            except OSError as exc:  # a broken pipe: the child is gone
                answer, problem = None, f"ledger writer process failed: {exc}"
            else:
                problem = "ledger writer process exited"
            if answer is None:
                self._died_locked()
                raise LedgerProcessError(problem)
            self._num_deaths = 0
        if "ok" in answer:
            return int(answer["ok"])
        if "invalid" in answer:
            raise ValueError(answer["invalid"])
        raise LedgerProcessError(answer.get("error", "ledger write failed"))

    def _died_locked(self) -> None:
        self._stop_locked()
        self._num_deaths += 1
        if self._num_deaths == MAX_DEATHS:
            where = "in-process from now on" if self._fallback is not None else "retrying"
            log.error("the ledger writer process died %d times in a row; writing %s",
                      MAX_DEATHS, where)

    def _stop_locked(self, timeout_s: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """Stop the child (it finishes the batch it is writing, if any)."""
        with self._lock:
            self._stop_locked()


def _serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    """The child's loop: one answer per batch until stdin closes."""
    from billing.db import make_engine, session_factory
    from billing.ledger import LedgerWriter
    from proxy.metering import entry_from_json

    hello = _receive(stdin)
    if hello is None:
        return
    engine = make_engine(hello["database_url"])
    writer = LedgerWriter(session_factory(engine))
    try:
        while (payloads := _receive(stdin)) is not None:
            try:
                answer: dict[str, Any] = {
                    "ok": writer.write([entry_from_json(p) for p in payloads])}
            except (ValueError, TypeError, KeyError) as exc:
                answer = {"invalid": f"{type(exc).__name__}: {exc}"}
            except Exception as exc:  # the database: the gateway keeps the batch
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            _send(stdout, answer)
    finally:
        engine.dispose()


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    with contextlib.suppress(OSError):
        os.nice(NICE_INCREMENT)
    channel = os.fdopen(os.dup(1), "wb")  # the answers; anything printed goes to stderr
    os.dup2(2, 1)
    _serve(sys.stdin.buffer, channel)


if __name__ == "__main__":
    main()
