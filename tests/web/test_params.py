"""Bucket pages tile ``[start_time, end_time)`` exactly, whatever the limit and alignment."""

from __future__ import annotations

from datetime import UTC, datetime

from hypothesis import given, settings
from hypothesis import strategies as st

from billing.usage import BucketWidth, bucket_floor
from web.params import encode_page, parse_bucket_page

NOW = datetime(2026, 6, 1, tzinfo=UTC)
BASE = int(datetime(2026, 1, 1, tzinfo=UTC).timestamp())


@settings(max_examples=200, deadline=None)
@given(
    offset=st.integers(0, 40 * 86400),
    length=st.integers(0, 20 * 86400),
    width=st.sampled_from(list(BucketWidth)),
    limit=st.integers(1, 31),
)
def test_pages_tile_the_range(offset: int, length: int, width: BucketWidth, limit: int) -> None:
    start, end = BASE + offset, BASE + offset + length
    buckets: list[tuple[datetime, datetime]] = []
    page_token: str | None = None
    for _ in range(10_000):
        page = parse_bucket_page(start_time=str(start), end_time=str(end),
                                 bucket_width=width.value, limit=str(limit), page=page_token,
                                 group_by=(), now=NOW)
        assert len(page.buckets) <= limit
        buckets.extend(page.buckets)
        if page.next_start is None:
            break
        page_token = encode_page(page.next_start)
    expected_start = datetime.fromtimestamp(start, UTC)
    for bucket_start, bucket_end in buckets:
        assert bucket_start == expected_start < bucket_end
        assert bucket_floor(bucket_start, width) == bucket_floor(bucket_end - width.delta / 10**6,
                                                                  width)
        expected_start = bucket_end
    assert expected_start == datetime.fromtimestamp(end if buckets else start, UTC)
