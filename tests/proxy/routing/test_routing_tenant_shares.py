"""Each tenant's share of a worker's KV cache, from its /load to the admin dashboard's row."""

from __future__ import annotations

from proxy.routing.fleet import tenant_shares_text
from proxy.routing.registry import parse_load


def test_load_tenants_become_the_dashboard_text() -> None:
    load = parse_load({
        "num_running": 1, "num_waiting": 0, "num_free_blocks": 50, "num_total_blocks": 200,
        "tenants": [
            {"tenant": "acme", "cached_blocks": 76, "reserved_blocks": 76},
            {"tenant": "bulk", "cached_blocks": 120, "reserved_blocks": 0},
            {"tenant": "broken"},  # skipped, not fatal
        ],
    })
    assert load.tenant_blocks == (("acme", 76, 76), ("bulk", 120, 0))
    assert tenant_shares_text(load) == (
        "bulk 60% (120 of 200 blocks); acme 38% (76 of 200 blocks, 76 reserved)"
    )
    assert parse_load({"tenants": "nonsense"}).tenant_blocks == ()
