"""Every request a gateway answered against its ledger: the bench's exactly-once check.

The ids are the responses' ``x-kvtoll-request-id``; the ledger may spell a UUID without
dashes, so both sides are compared as UUID hex.
"""

from __future__ import annotations

import time
import uuid
from typing import Any


def ledger_ids(database_url: str) -> list[str]:
    from sqlalchemy import create_engine, text

    engine = create_engine(database_url)
    with engine.connect() as conn:
        ids = [str(r) for r in conn.execute(text("SELECT request_id FROM usage_ledger")).scalars()]
    engine.dispose()
    return ids


def _uuid_hex(request_id: str) -> str:
    """The same id however it is spelled (the ledger may store UUIDs without dashes)."""
    try:
        return uuid.UUID(request_id).hex
    except ValueError:
        return request_id


def check(database_url: str, answered: list[str], timeout_s: float = 30.0) -> dict[str, Any]:
    """Once the outbox drained (the rows caught up, or ``timeout_s``): answered, rows,
    lost (answered, no row), extra (a row never answered) and doubled."""
    deadline = time.monotonic() + timeout_s
    rows = ledger_ids(database_url)
    while len(rows) < len(answered) and time.monotonic() < deadline:
        time.sleep(0.2)
        rows = ledger_ids(database_url)
    have, want = {_uuid_hex(r) for r in rows}, {_uuid_hex(r) for r in answered}
    return {"answered": len(answered), "ledger_rows": len(rows),
            "lost": len(want - have), "extra": len(have - want),
            "doubled": len(rows) - len(have) + (len(answered) - len(want))}
