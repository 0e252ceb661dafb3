"""bench/policy_propagation.py: one trial over two real gateways on one database, each in
front of its own real worker; the new reservation reaches both workers through the
tenant's requests, none of which fails."""

from __future__ import annotations

import asyncio

from bench import policy_propagation


def test_a_policy_change_reaches_both_workers_through_both_gateways() -> None:
    args = policy_propagation.build_parser().parse_args(["--trials", "1", "--interval", "0.1"])
    out = asyncio.run(policy_propagation.run(args))
    assert out["all_reached"] is True
    assert len(out["trials"]) == 1 and len(out["trials"][0]) == 2
    assert out["num_failed_requests"] == 0
