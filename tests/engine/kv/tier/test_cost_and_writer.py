"""The load-or-recompute decision and the write-behind queue's bound."""

from __future__ import annotations

import torch

from engine.kv.hashing import BlockHash
from engine.kv.tier.codec import BlockKey, TierMode
from engine.kv.tier.cost import LoadCost
from engine.kv.tier.host_store import HostTier
from engine.kv.tier.write_behind import WriteBehind, WriteJob


def test_loads_until_measured_then_follows_the_measurements_and_probes() -> None:
    cost = LoadCost(alpha=1.0, probe_every=4)
    assert cost.worth_loading(16)  # nothing measured: load (and so measure)
    cost.observe_prefill(160, 1.0)  # 1/160 s per token: a block costs 0.1 s
    cost.observe_load(2, 0.1)  # 0.05 s per block
    assert cost.worth_loading(16) and cost.load_fraction(16) == 0.5
    cost.observe_load(1, 0.5)  # now 0.5 s per block: recompute is cheaper
    decisions = [cost.worth_loading(16) for _ in range(8)]
    assert decisions == [False, False, False, True] * 2  # one probe every 4


def _job(n: int) -> WriteJob:
    keys = tuple(BlockKey("m", None, BlockHash(i.to_bytes(16, "big"))) for i in range(n))
    return WriteJob(keys, torch.zeros(n, 1, 2, 2, 1, 2), to_host=True, to_shared=False)


def test_write_behind_stores_and_drops_beyond_its_backlog() -> None:
    host = HostTier(1 << 20)
    writer = WriteBehind(host, None, TierMode.RAW, max_blocks=4)
    assert not writer.submit(_job(5)) and writer.num_dropped == 5
    assert writer.submit(_job(3))
    writer.drain()
    assert host.stats.stores == 3
    writer.close()
