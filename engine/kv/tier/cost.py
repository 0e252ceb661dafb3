"""Load or recompute: the worker's own measurements decide (policy module).

Algorithm: exponential moving averages (weight ``alpha`` for the newest sample) of
seconds per block loaded from the tier into the pool (decode + checksum + copy) and
of seconds per prefilled token (the model steps that computed at least one block's
worth of tokens). A run of ``n`` tier blocks is loaded iff
``load_s_per_block < block_size * prefill_s_per_token``; before both are measured it
is loaded (that is how the first load is measured). After ``probe_every``
consecutive "recompute" decisions one load is tried again, so a transient slow
load cannot switch the tier off for good.

Parameters: ``alpha`` 0.2, ``probe_every`` 32.
"""

from __future__ import annotations

import threading


class LoadCost:
    """Measured per-block load cost against per-token prefill cost."""

    def __init__(self, alpha: float = 0.2, probe_every: int = 32) -> None:
        self.alpha = alpha
        self.probe_every = probe_every
        self.load_s_per_block: float | None = None
        self.prefill_s_per_token: float | None = None
        self._skipped = 0
        self._lock = threading.Lock()

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def observe_load(self, num_blocks: int, seconds: float) -> None:
        if num_blocks > 0:
            with self._lock:
                self.load_s_per_block = self._ema(self.load_s_per_block, seconds / num_blocks)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0:
            with self._lock:
                self.prefill_s_per_token = self._ema(self.prefill_s_per_token, seconds / num_tokens)

    def worth_loading(self, block_size: int) -> bool:
        """Whether loading a block beats recomputing its ``block_size`` tokens."""
        with self._lock:
            load, prefill = self.load_s_per_block, self.prefill_s_per_token
            if load is None or prefill is None or load < block_size * prefill:
                self._skipped = 0
                return True
            self._skipped += 1
            if self._skipped >= self.probe_every:
                self._skipped = 0
                return True
            return False

    def load_fraction(self, block_size: int) -> float | None:
        """Load cost as a fraction of recompute cost (None until both are measured)."""
        with self._lock:
            if self.load_s_per_block is None or not self.prefill_s_per_token:
                return None
            return self.load_s_per_block / (block_size * self.prefill_s_per_token)
