"""Property test: random allocate / share / append / free / evict / preempt / abort /
tenant-share sequences over the block pool and KV manager keep every invariant, and an
admission never takes another tenant's reserved cached blocks."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from engine.api import KVShare
from engine.kv.block_pool import BlockPool
from engine.kv.hashing import BlockHash, TenantSalt
from engine.kv.kv_manager import KVCacheManager

BS = 4
NUM_BLOCKS = 12
SALTS = (None, TenantSalt(b"a"), TenantSalt(b"b"))
# a tiny alphabet and shared stems so that prefixes collide often
STEMS = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5])


@dataclass
class Seq:
    seq_id: int
    token_ids: list[int]
    salt: TenantSalt | None
    num_computed_tokens: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    running: bool = False


class KVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(BlockPool(NUM_BLOCKS, BS))
        self.seqs: dict[int, Seq] = {}
        self.next_id = 0

    @rule(
        stem=st.sampled_from(STEMS),
        tail=st.lists(st.integers(0, 3), max_size=6),
        salt=st.sampled_from(SALTS),
    )
    def add(self, stem: list[int], tail: list[int], salt: TenantSalt | None) -> None:
        self.seqs[self.next_id] = Seq(self.next_id, [*stem, *tail], salt)
        self.next_id += 1

    @rule(
        salt=st.sampled_from(SALTS),
        reserved=st.integers(0, NUM_BLOCKS),
        extra=st.none() | st.integers(0, NUM_BLOCKS),
    )
    def set_share(self, salt: TenantSalt | None, reserved: int, extra: int | None) -> None:
        cap = None if extra is None else reserved + extra
        self.kv.pool.set_share(salt, KVShare("t", reserved, cap))

    @rule(data=st.data(), chunk=st.integers(1, 12), use_reserved=st.booleans())
    def admit_or_step(self, data: st.DataObject, chunk: int, use_reserved: bool) -> None:
        """Admission (with prefix sharing) or one more prefill/decode chunk."""
        if not self.seqs:
            return
        seq = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        prefix = self.kv.find_prefix(seq) if not seq.running else []
        n = min(chunk, len(seq.token_ids) - seq.num_computed_tokens - len(prefix) * BS)
        if n <= 0:
            return
        before = seq.num_computed_tokens
        held = {o: (t.num_cached, t.share.reserved_blocks) for o, t in self.kv.pool.tenants.items()}
        can = self.kv.can_allocate(seq, n, prefix, use_reserved)
        ok = self.kv.allocate_slots(seq, n, prefix, use_reserved)
        assert ok == can
        if not use_reserved:
            for owner, (num_cached, reserved) in held.items():
                if owner != seq.salt:
                    assert self.kv.pool.tenants.get(owner).num_cached >= min(num_cached, reserved)
        if ok:
            assert seq.num_computed_tokens == before  # the manager never writes progress
            seq.running = True
            seq.num_computed_tokens += len(prefix) * BS + n
            self.kv.cache_full_blocks(seq)

    @rule(data=st.data(), new=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def append(self, data: st.DataObject, new: list[int]) -> None:
        """Decode: sampled tokens join a sequence whose tokens are all computed."""
        done = [
            s for s in self.seqs.values() if s.running and s.num_computed_tokens == len(s.token_ids)
        ]
        if done:
            data.draw(st.sampled_from(done)).token_ids.extend(new)

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        if self.seqs:
            seq = self.seqs.pop(data.draw(st.sampled_from(sorted(self.seqs))))
            self.kv.free(seq)

    @rule(data=st.data())
    def abort_mid_prefill(self, data: st.DataObject) -> None:
        partial = [
            s for s in self.seqs.values() if s.running and s.num_computed_tokens < len(s.token_ids)
        ]
        if partial:
            seq = data.draw(st.sampled_from(partial))
            self.kv.free(self.seqs.pop(seq.seq_id))

    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        running = [s for s in self.seqs.values() if s.running]
        if running:
            seq = data.draw(st.sampled_from(running))
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            seq.running = False

    @rule()
    def evict_all(self) -> None:
        self.kv.pool.evict_all_free()

    @invariant()
    def ref_counts_match_tables(self) -> None:
        refs: Counter[int] = Counter()
        for s in self.seqs.values():
            ids = self.kv.block_ids(s.seq_id)
            assert ids == tuple(b.block_id for b in self.kv.blocks(s.seq_id))  # kept ids
            assert len(ids) == len(set(ids))
            assert len(ids) * BS >= s.num_computed_tokens
            refs.update(ids)
        pool = self.kv.pool
        for b in pool.blocks:
            assert b.ref_cnt >= 0
            assert b.ref_cnt == refs[b.block_id]
            assert b.in_free_queue == (b.ref_cnt == 0)
        used = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert pool.num_free_blocks + used == NUM_BLOCKS

    @invariant()
    def no_block_shared_across_salts(self) -> None:
        owner: dict[int, TenantSalt | None] = {}
        for s in self.seqs.values():
            for bid in self.kv.block_ids(s.seq_id):
                assert owner.setdefault(bid, s.salt) == s.salt

    @invariant()
    def hash_map_consistent(self) -> None:
        for h, b in self.kv.pool.cached.items():
            assert b.block_hash == h
            assert len(b.token_ids) == BS

    @invariant()
    def tenant_counts_match_blocks(self) -> None:
        pool = self.kv.pool
        for owner, state in pool.tenants.items():
            mine = [b for b in pool.blocks if b.block_hash is not None and b.owner == owner]
            assert state.num_cached == len(mine)
            assert sorted(b.block_id for b in state.free) == sorted(
                b.block_id for b in mine if b.ref_cnt == 0
            )
            cap = state.share.max_blocks
            assert cap is None or state.num_cached <= cap or not state.free  # over: all in use
        assert len(pool.uncached) + pool.tenants.num_free_cached() == pool.num_free_blocks

    def teardown(self) -> None:
        for s in list(self.seqs.values()):
            self.kv.free(s)
        pool = self.kv.pool
        assert pool.num_free_blocks == NUM_BLOCKS
        assert all(b.ref_cnt == 0 for b in pool.blocks)


KVMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVStateMachine = KVMachine.TestCase
