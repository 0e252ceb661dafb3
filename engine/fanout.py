"""Fan-out: a request with ``n`` choices becomes ``n`` sequences sharing its prompt.

Policy: choice 0 runs at once; choices 1..n-1 are *held* until choice 0 has computed
the whole prompt, then join the head of the waiting queue (in choice order), so they
start from its cached prompt blocks instead of each prefilling the same prompt. Every
choice still computes the last, partial block itself and samples its first token
from that computation, with its own generator (seeded from ``seed + index``).

The scheduler owns the one :class:`FanOut`: it queues the choice that runs, asks for
the held ones when a sequence has computed its prompt, and drops a held choice that
is aborted before it ran. Sequence ids and arrival order are numbered here.
"""

from __future__ import annotations

import itertools

from engine.api import GenerationRequest
from engine.sampling import make_generator
from engine.sequence import Sequence


class FanOut:
    """Makes each request's choices and holds back all but the first."""

    def __init__(self) -> None:
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._held: dict[str, list[Sequence]] = {}

    def split(self, request: GenerationRequest) -> list[Sequence]:
        """The request's ``n`` choices; all but choice 0 are held."""
        if request.request_id in self._held:
            raise RuntimeError(f"request {request.request_id!r} already has held choices")
        arrival = next(self._arrivals)
        choices = [
            Sequence(
                seq_id=next(self._seq_ids),
                request_id=request.request_id,
                index=i,
                token_ids=list(request.prompt_token_ids),
                num_prompt_tokens=len(request.prompt_token_ids),
                sampling=request.sampling,
                salt=request.salt,
                arrival=arrival,
                generator=make_generator(request.sampling, i),
            )
            for i in range(request.sampling.n)
        ]
        if len(choices) > 1:
            self._held[request.request_id] = choices[1:]
        return choices

    def release(self, seq: Sequence) -> list[Sequence]:
        """The held choices of ``seq``'s request, now that ``seq`` (its choice 0) has
        computed the prompt; empty if none are held."""
        return self._held.pop(seq.request_id, [])

    def drop(self, seq: Sequence) -> bool:
        """Forget ``seq`` if it is held (aborted before it ran); whether it was."""
        held = self._held.get(seq.request_id, [])
        if seq not in held:
            return False
        held.remove(seq)
        if not held:
            del self._held[seq.request_id]
        return True

    def num_held(self) -> int:
        """Choices waiting for their choice 0 to compute the prompt."""
        return sum(len(h) for h in self._held.values())
