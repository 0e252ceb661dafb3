"""The embeddings of recent (tenant, text) pairs, kept between a lookup and the store
that follows it, so that a miss's answer is stored without embedding its prompt twice.
Keyed per tenant: a memo shared between tenants would leak, through its timing, which
texts another tenant asked. Least recently used first out."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable

import numpy as np


class EmbedMemo:
    """At most ``size`` vectors; :meth:`embed` computes the missing ones with ``compute``."""

    def __init__(self, size: int, compute: Callable[[str], Awaitable[np.ndarray]]) -> None:
        self._size = size
        self._compute = compute
        self._vectors: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return len(self._vectors)

    async def embed(self, tenant_id: str, text: str) -> np.ndarray:
        """``text``'s vector for ``tenant_id``: the memo's, else computed and kept."""
        key = (tenant_id, text)
        found = self._vectors.get(key)
        if found is not None:
            self._vectors.move_to_end(key)
            return found
        vector = await self._compute(text)
        self._vectors[key] = vector
        if len(self._vectors) > self._size:
            self._vectors.popitem(last=False)
        return vector
