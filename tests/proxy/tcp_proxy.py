"""The loopback TCP forwarder of the fault tests (:mod:`bench.tcp_proxy`, shared with the
chaos bench): cut (refused), blackholed (packets lost) and restored, to make one
dependency unreachable without touching the shared PostgreSQL or Redis server."""

from __future__ import annotations

from bench.tcp_proxy import TcpProxy

__all__ = ["TcpProxy"]
