"""Tier 2 of the KV cache: blocks evicted from the engine's pool, kept on the host
(optionally spilling to disk) and shared between workers through Redis.

::

    engine pool (L1) --evict / cache--> offloader thread --encode--> host tier (+ spill dir)
                                                        \\-------> shared store (Redis)
    prefill admission <--promote-- host tier <--prefetch (off the step loop)-- shared store

Every block is keyed by (model, tenant salt, salted block hash) and its bytes carry a
checksum over that key and the payload (:mod:`engine.kv.tier.codec`): a corrupt or
foreign block is dropped and recomputed, never used.
"""
