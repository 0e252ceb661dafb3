"""Routing policies, one module each; see :mod:`proxy.routing.policy` for the interface."""
