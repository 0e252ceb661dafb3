"""Free-block queue: an intrusive doubly linked list with O(1) removal (vLLM v1 style).

Each :class:`KVBlock` carries its own ``prev``/``next`` links, so a cached block that
gets a prefix hit while free is unlinked in O(1) without searching. Order is the
eviction order: :meth:`FreeBlockQueue.popleft` takes the head (least recently used
or never-cached blocks), freed cached blocks join the tail::

    head <-> b7 <-> b2 <-> b9 <-> tail        popleft() -> b7; remove(b2) in O(1)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NewType

from engine.kv.hashing import BlockHash, TenantSalt

BlockId = NewType("BlockId", int)


@dataclass(eq=False)
class KVBlock:
    """One fixed-size block of KV slots, shared by ref count."""

    block_id: BlockId
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()  # the tokens whose K/V it holds, once full and cached
    owner: TenantSalt | None = None  # the salt of the tenant whose hash it holds
    freed_at: int = 0  # when its ref count last fell to 0 (orders LRU across tenants)
    prev: KVBlock | None = field(default=None, repr=False)
    next: KVBlock | None = field(default=None, repr=False)
    in_free_queue: bool = False


class FreeBlockQueue:
    """Doubly linked list of free blocks; head = evicted/reused first."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head: KVBlock | None = None
        self._tail: KVBlock | None = None
        self._len = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self._len

    @property
    def head(self) -> KVBlock | None:
        """The block :meth:`popleft` would return, or None."""
        return self._head

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head
        while node is not None:
            yield node
            node = node.next

    def append(self, block: KVBlock) -> None:
        """Link ``block`` at the tail (evicted last)."""
        self._check_unlinked(block)
        block.prev, block.next = self._tail, None
        if self._tail is None:
            self._head = block
        else:
            self._tail.next = block
        self._tail = block
        self._link(block)

    def appendleft(self, block: KVBlock) -> None:
        """Link ``block`` at the head (reused first)."""
        self._check_unlinked(block)
        block.prev, block.next = None, self._head
        if self._head is None:
            self._tail = block
        else:
            self._head.prev = block
        self._head = block
        self._link(block)

    def popleft(self) -> KVBlock:
        """Unlink and return the head block."""
        if self._head is None:
            raise RuntimeError("no free blocks")
        block = self._head
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        """Unlink ``block`` from anywhere in the queue in O(1)."""
        if not block.in_free_queue:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        if block.prev is None:
            self._head = block.next
        else:
            block.prev.next = block.next
        if block.next is None:
            self._tail = block.prev
        else:
            block.next.prev = block.prev
        block.prev = block.next = None
        block.in_free_queue = False
        self._len -= 1

    def _link(self, block: KVBlock) -> None:
        block.in_free_queue = True
        self._len += 1

    @staticmethod
    def _check_unlinked(block: KVBlock) -> None:
        if block.in_free_queue:
            raise RuntimeError(f"block {block.block_id} is already in the free queue")
