"""Whether an upstream reports the cached part of its prompts, which billing needs.

The gateway bills a prompt's prefix-cached tokens at the cached price only when the
upstream says how many there were (``usage.prompt_tokens_details.cached_tokens``).
kvtoll workers always do; vLLM only when started with ``--enable-prompt-tokens-details``
and SGLang with ``--enable-cache-report``. Without them every request reports
``cached_tokens: 0`` and is billed at full price although the upstream reused the
prefix. :class:`UsageReportWatch` notices the first response without the field,
logs one WARNING naming the flag, and keeps the finding for ``/readyz``.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

UPSTREAM_FLAGS = "vLLM: --enable-prompt-tokens-details; SGLang: --enable-cache-report"


class UsageReportWatch:
    """One upstream's finding: unknown until a response's usage arrives, then whether
    it carried ``prompt_tokens_details`` (latched on the first response without it)."""

    def __init__(self, upstream_name: str) -> None:
        self._name = upstream_name
        self._missing = False
        self._seen = False

    def observe(self, reported_cached_tokens: bool) -> None:
        """Record one response; warn once, at the first that lacked the field."""
        self._seen = True
        if reported_cached_tokens or self._missing:
            return
        self._missing = True
        log.warning("%s", self.problem())

    def problem(self) -> str | None:
        """The warning for ``/readyz``, or ``None`` while no response lacked the field."""
        if not self._missing:
            return None
        return (f"upstream {self._name} reports no prompt_tokens_details.cached_tokens: its "
                "prefix-cache hits are billed at full price (start it with the flag that "
                f"reports them; {UPSTREAM_FLAGS})")
