"""The routing-policy interface and the factory that builds a policy by name.

A policy ranks the candidate workers of one request, best first; the proxy tries
them in that order (the next one only if the previous failed before streaming).
Policies may keep state (a rotation counter) but never touch the network.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from proxy.routing.types import Candidate, RouteRequest, WorkerId


class Policy(Protocol):
    """Orders candidate workers for one request."""

    @property
    def name(self) -> str: ...

    def rank(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[WorkerId]:
        """Every candidate's worker id exactly once, best first."""
        ...


POLICY_NAMES = ("cache_aware", "round_robin", "least_loaded", "consistent_hash")


def make_policy(name: str) -> Policy:
    """A fresh policy with its documented defaults. ``ValueError`` for an unknown name."""
    from proxy.routing.policies.cache_aware import CacheAwarePolicy
    from proxy.routing.policies.consistent_hash import ConsistentHashPolicy
    from proxy.routing.policies.least_loaded import LeastLoadedPolicy
    from proxy.routing.policies.round_robin import RoundRobinPolicy

    factories: dict[str, Callable[[], Policy]] = {
        "cache_aware": CacheAwarePolicy,
        "round_robin": RoundRobinPolicy,
        "least_loaded": LeastLoadedPolicy,
        "consistent_hash": ConsistentHashPolicy,
    }
    factory = factories.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; expected one of {POLICY_NAMES}")
    return factory()
