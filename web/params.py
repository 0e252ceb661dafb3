"""Query parameters of the usage and costs APIs, parsed as OpenAI documents them.

``start_time`` (required) and ``end_time`` are unix seconds, ``[start, end)``;
``bucket_width`` is ``1h`` or ``1d`` (default ``1d``); ``limit`` counts buckets
per page (1d: default 7, max 31; 1h: default 24, max 168); ``page`` is the
opaque ``next_page`` cursor of the previous answer; ``group_by`` repeats or is
comma-separated. Buckets are aligned to UTC hours / days.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from billing.usage import BucketWidth, GroupBy, bucket_floor
from web.errors import bad_param

LIMITS = {BucketWidth.DAY: (7, 31), BucketWidth.HOUR: (24, 168)}
MAX_UNIX = 221845392000  # 9000-01-01: far enough, and bucket ends never overflow
MIN_YEAR, MAX_YEAR = 1970, 9998


@dataclass(frozen=True)
class BucketPage:
    """The buckets one answer covers, and where the next page starts (if any)."""

    start: datetime
    end: datetime
    width: BucketWidth
    group_by: tuple[GroupBy, ...]
    buckets: tuple[tuple[datetime, datetime], ...]
    next_start: datetime | None


MAX_NUMBER_DIGITS = 18  # beyond any id, limit or unix time; int() refuses > 4300 digits


def is_number(text: str) -> bool:
    """True for a plain ASCII decimal number (no sign, space or Unicode digits) short
    enough to convert."""
    return len(text) <= MAX_NUMBER_DIGITS and text.isascii() and text.isdigit()


def _unix(name: str, text: str | None) -> datetime | None:
    if text is None or text == "":
        return None
    if not is_number(text) or int(text) > MAX_UNIX:
        raise bad_param(name, f"{name} must be a unix time in seconds, got {text!r}")
    return datetime.fromtimestamp(int(text), tz=UTC)


def _limit(text: str | None, width: BucketWidth) -> int:
    default, maximum = LIMITS[width]
    if text is None or text == "":
        return default
    if not is_number(text) or not 1 <= int(text) <= maximum:
        raise bad_param("limit", f"limit must be an integer from 1 to {maximum} for {width}")
    return int(text)


def encode_page(moment: datetime) -> str:
    return "page_" + base64.urlsafe_b64encode(str(int(moment.timestamp())).encode()).decode()


def _decode_page(text: str) -> datetime:
    try:
        raw = base64.urlsafe_b64decode(text.removeprefix("page_").encode()).decode()
    except (binascii.Error, UnicodeDecodeError):
        raw = ""
    moment = _unix("page", raw) if is_number(raw) else None
    if moment is None:
        raise bad_param("page", "page is not a cursor returned by this API")
    return moment


def parse_group_by(values: Sequence[str] | None, allowed: Sequence[GroupBy]) -> tuple[GroupBy, ...]:
    """``group_by`` values (repeated and/or comma-separated), each one of ``allowed``."""
    names = [n.strip() for v in values or () for n in v.split(",") if n.strip()]
    choices = {g.value: g for g in allowed}
    unknown = [n for n in names if n not in choices]
    if unknown:
        raise bad_param("group_by", f"cannot group by {unknown[0]!r}: use {', '.join(choices)}")
    return tuple(g for g in allowed if g.value in names)


def parse_bucket_page(
    *,
    start_time: str | None,
    end_time: str | None,
    bucket_width: str | None,
    limit: str | None,
    page: str | None,
    group_by: tuple[GroupBy, ...],
    now: datetime,
) -> BucketPage:
    """Validate the parameters into the buckets of the requested page."""
    start = _unix("start_time", start_time)
    if start is None:
        raise bad_param("start_time", "start_time is required (unix seconds)")
    end = _unix("end_time", end_time) or max(now, start)
    if end < start:
        raise bad_param("end_time", "end_time must not be before start_time")
    try:
        width = BucketWidth(bucket_width or "1d")
    except ValueError:
        raise bad_param("bucket_width", "bucket_width must be 1h or 1d") from None
    count = _limit(limit, width)
    first = _decode_page(page) if page else start
    if not start <= first <= end:
        raise bad_param("page", "page cursor lies outside start_time..end_time")
    buckets: list[tuple[datetime, datetime]] = []
    cursor = first
    while cursor < end and len(buckets) < count:
        bucket_end = min(bucket_floor(cursor, width) + width.delta, end)
        buckets.append((cursor, bucket_end))
        cursor = bucket_end
    return BucketPage(
        start=first, end=cursor, width=width, group_by=group_by, buckets=tuple(buckets),
        next_start=cursor if cursor < end else None,
    )


def day_range(start: str | None, end: str | None, today: datetime) -> tuple[datetime, datetime]:
    """Dashboard date range: ISO dates, end inclusive; default the last 30 days.

    Raises ``ValueError`` with a readable message for bad dates or a reversed range.
    """
    last = _iso_day(end, "end") if end else bucket_floor(today, BucketWidth.DAY)
    first = _iso_day(start, "start") if start else last - timedelta(days=29)
    if last < first:
        raise ValueError("the end date is before the start date")
    if (last - first).days > 366:
        raise ValueError("pick a range of at most 366 days")
    return first, last + timedelta(days=1)


def picked_range(
    start: str | None, end: str | None, today: datetime
) -> tuple[datetime, datetime, str | None]:
    """:func:`day_range`, falling back to the default range with the reason on bad input."""
    try:
        return (*day_range(start, end, today), None)
    except ValueError as exc:
        return (*day_range(None, None, today), str(exc))


def range_fields(first: datetime, stop: datetime) -> dict[str, str]:
    """The date picker's values for ``[first, stop)`` (end shown inclusive)."""
    return {"start": first.date().isoformat(), "end": (stop - timedelta(days=1)).date().isoformat()}


def _iso_day(text: str, what: str) -> datetime:
    try:
        day = datetime.strptime(text, "%Y-%m-%d")
    except ValueError:
        raise ValueError(f"the {what} date must look like 2026-01-31") from None
    if not MIN_YEAR <= day.year <= MAX_YEAR:
        raise ValueError(f"the {what} date must be between {MIN_YEAR} and {MAX_YEAR}")
    return day.replace(tzinfo=UTC)
