"""What the gateway hands a route: a :class:`Reply` in flight (its items, tally and
headers), and the error raised when no upstream could answer."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass

from kvtoll.openai.errors import SERVER_ERROR, OpenAIError
from proxy.tally import Item, Tally


async def _nothing() -> None:
    return None


@dataclass
class Reply:
    """A response in flight: iterate ``items`` at most once, then :meth:`aclose` it
    (always, also when ``items`` was never started)."""

    request_id: str
    worker: str | None
    semantic: bool
    no_cache: bool
    items: AsyncGenerator[Item, None]
    tally: Tally
    similarity: float | None = None
    abandon: Callable[[], Awaitable[None]] = _nothing
    budget_alert: str | None = None  # x-kvtoll-budget-alert, e.g. "83%"

    async def aclose(self) -> None:
        """Close ``items``; if they were never read, close the upstream and write the
        request's ledger row here (``client_disconnect``, shielded from cancellation)."""
        await self.items.aclose()
        await self.abandon()

    def cache_header(self) -> str:
        """``x-kvtoll-cache``: semantic | prefix | bypass | miss (prefix: the usage, or the
        first delta's counts for a response still streaming, reports cached tokens)."""
        if self.semantic:
            return "semantic"
        if self.tally.prompt_cached() > 0:
            return "prefix"
        return "bypass" if self.no_cache else "miss"


class UpstreamUnavailable(OpenAIError):
    """502 ``upstream_unavailable``; 504 ``upstream_timeout`` when every upstream tried
    stayed silent past its timeout."""

    def __init__(self, detail: str, *, timed_out: bool = False) -> None:
        super().__init__(
            f"No upstream could serve the request: {detail}", status=504 if timed_out else 502,
            type=SERVER_ERROR, code="upstream_timeout" if timed_out else "upstream_unavailable",
        )
