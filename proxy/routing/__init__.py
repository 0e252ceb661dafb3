"""Prefix-aware routing across engine workers (L2): index, policies, registry, router."""
