"""Vector index for one cache partition: exact while small, HNSW past a size.

Algorithm
---------
* Vectors are L2-normalised float32, scored by inner product (= cosine).
* Below ``hnsw_threshold`` live vectors the index is ``IndexIDMap(IndexFlatIP)``:
  exact search, true deletions via ``remove_ids``.
* When an add takes it past ``hnsw_threshold``, it is rebuilt as
  ``IndexIDMap(IndexHNSWFlat(M=hnsw_m, inner product))`` with ``efConstruction`` and
  ``efSearch`` as given. HNSW cannot delete, so a removed id becomes a tombstone:
  searches ask for ``k + tombstones`` results and drop them, and once tombstones
  exceed ``rebuild_fraction`` of the graph it is rebuilt from the live vectors
  (back to flat if they fell below half the threshold).
* Live vectors are also kept in a dict (id -> row) so rebuilds need no store reads.
  The whole index is rebuilt from the store on restart by the service.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt


class VectorIndex(Protocol):
    """Integer ids -> vectors with inner-product top-k search."""

    def add(self, ids: npt.NDArray[np.int64], vectors: npt.NDArray[np.float32]) -> None: ...

    def remove(self, ids: npt.NDArray[np.int64]) -> None: ...

    def search(self, vector: npt.NDArray[np.float32], k: int) -> list[tuple[int, float]]: ...

    def __len__(self) -> int: ...


@dataclass(frozen=True)
class IndexConfig:
    """Parameters of :class:`FaissIndex` (see the module docstring)."""

    hnsw_threshold: int = 4096
    hnsw_m: int = 32
    ef_construction: int = 64
    ef_search: int = 64
    rebuild_fraction: float = 0.25


class FaissIndex:
    """One partition's FAISS index; ids are caller-chosen non-negative int64."""

    def __init__(self, dim: int, config: IndexConfig | None = None) -> None:
        if dim < 1:
            raise ValueError("dim must be positive")
        self._dim = dim
        self._config = config or IndexConfig()
        self._vectors: dict[int, npt.NDArray[np.float32]] = {}
        self._tombstones: set[int] = set()
        self._hnsw = False
        self._index: Any = self._new_flat()

    @property
    def is_hnsw(self) -> bool:
        return self._hnsw

    def __len__(self) -> int:
        return len(self._vectors)

    def __contains__(self, item_id: int) -> bool:
        return item_id in self._vectors

    def add(self, ids: npt.NDArray[np.int64], vectors: npt.NDArray[np.float32]) -> None:
        """Add (or replace) vectors under ``ids``."""
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        vectors = np.ascontiguousarray(vectors, dtype=np.float32).reshape(len(ids), -1)
        if vectors.shape[1] != self._dim:
            raise ValueError(f"expected vectors of dim {self._dim}, got {vectors.shape[1]}")
        if len(set(ids.tolist())) != len(ids) or (len(ids) and ids.min() < 0):
            raise ValueError("ids must be distinct and non-negative")
        replaced = np.array([i for i in ids.tolist() if i in self._vectors], dtype=np.int64)
        if len(replaced):
            self.remove(replaced)
        for item_id, row in zip(ids.tolist(), vectors, strict=True):
            self._vectors[item_id] = row.copy()
        revived = self._hnsw and any(i in self._tombstones for i in ids.tolist())
        if revived or (not self._hnsw and len(self._vectors) > self._config.hnsw_threshold):
            self._rebuild()  # HNSW cannot hold a tombstoned id twice: rebuild instead
        else:
            self._index.add_with_ids(vectors, ids)

    def remove(self, ids: npt.NDArray[np.int64]) -> None:
        """Remove ``ids``; unknown ids are ignored."""
        present = [
            i for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist() if i in self._vectors
        ]
        if not present:
            return
        for item_id in present:
            del self._vectors[item_id]
        if not self._hnsw:
            self._index.remove_ids(np.array(present, dtype=np.int64))
            return
        self._tombstones.update(present)
        graph_size = len(self._vectors) + len(self._tombstones)
        if len(self._tombstones) > self._config.rebuild_fraction * graph_size:
            self._rebuild()

    def search(self, vector: npt.NDArray[np.float32], k: int) -> list[tuple[int, float]]:
        """Up to ``k`` live ``(id, score)`` pairs, best first."""
        if k < 1 or not self._vectors:
            return []
        query = np.ascontiguousarray(vector, dtype=np.float32).reshape(1, self._dim)
        fetch = min(k + len(self._tombstones), self._index.ntotal)
        scores, ids = self._index.search(query, fetch)
        out: list[tuple[int, float]] = []
        for item_id, score in zip(ids[0].tolist(), scores[0].tolist(), strict=True):
            if item_id < 0 or item_id in self._tombstones:
                continue
            out.append((item_id, float(score)))
            if len(out) == k:
                break
        return out

    def _rebuild(self) -> None:
        self._tombstones.clear()
        use_hnsw = len(self._vectors) > self._config.hnsw_threshold or (
            self._hnsw and len(self._vectors) >= self._config.hnsw_threshold // 2
        )
        self._hnsw = use_hnsw
        self._index = self._new_hnsw() if use_hnsw else self._new_flat()
        if self._vectors:
            ids = np.fromiter(self._vectors.keys(), dtype=np.int64, count=len(self._vectors))
            self._index.add_with_ids(np.stack(list(self._vectors.values())), ids)

    def _new_flat(self) -> Any:
        import faiss

        return faiss.IndexIDMap(faiss.IndexFlatIP(self._dim))

    def _new_hnsw(self) -> Any:
        import faiss

        inner = faiss.IndexHNSWFlat(self._dim, self._config.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        inner.hnsw.efConstruction = self._config.ef_construction
        inner.hnsw.efSearch = self._config.ef_search
        return faiss.IndexIDMap(inner)
