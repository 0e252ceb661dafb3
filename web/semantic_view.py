"""The semantic cache's error bound as the dashboards show it (plain rows in, no proxy
import: the gateway hands a callable that returns one mapping per tenant with
``tenant_id``, ``tenant``, ``hits``, ``explored``, ``explored_checked``,
``wrong_hit_rate`` (None before any check), its 95% interval ``wrong_hit_rate_low`` /
``_high`` and ``max_error_rate``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

SemanticRows = Sequence[Mapping[str, Any]]
SemanticStatusFn = Callable[[], SemanticRows]


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * float(value):.2f}%"


def bound_view(
    status: SemanticStatusFn | None, tenant_id: int | None = None
) -> list[dict[str, Any]]:
    """Display rows (all tenants, or only ``tenant_id``'s); a failing callable shows as
    no rows, never a 500."""
    if status is None:
        return []
    try:
        rows = list(status())
    except Exception:
        return []
    out = []
    for row in rows:
        if tenant_id is not None and row.get("tenant_id") != tenant_id:
            continue
        out.append({
            "tenant": str(row.get("tenant", "")), "hits": int(row.get("hits", 0)),
            "explored": int(row.get("explored", 0)),
            "checked": int(row.get("explored_checked", 0)),
            "wrong_hit_rate": _pct(row.get("wrong_hit_rate")),
            "interval": "-" if row.get("wrong_hit_rate") is None else
                        f"{_pct(row.get('wrong_hit_rate_low'))} – "
                        f"{_pct(row.get('wrong_hit_rate_high'))}",
            "bound": _pct(row.get("max_error_rate")),
        })  # fmt: skip
    return out
