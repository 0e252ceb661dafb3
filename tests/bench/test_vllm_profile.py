"""bench.vllm_profile's reading of a torch profiler table and its phase sums."""

from __future__ import annotations

import pytest

from bench.vllm_profile import parse_seconds, parse_table, phase_of, phases

COLUMNS = ("Name", "Self CPU %", "Self CPU", "CPU total %", "CPU total", "CPU time avg",
           "# of Calls")  # fmt: skip
ROWS = (
    ("_C::onednn_mm", "60.00%", "1.200s", "60.00%", "1.200s", "100.000us", "12000"),
    ("_C::paged_attention_v1_cpu", "25.00%", "500.000ms", "25.00%", "500.000ms", "50.000us",
     "10000"),
    ("_C::fused_add_rms_norm", "5.00%", "100.000ms", "5.00%", "100.000ms", "10.000us", "10000"),
    ("cpp_fused_silu_mul_0", "5.00%", "100.000ms", "5.00%", "100.000ms", "10.000us", "10000"),
    ("aten::argmax", "5.00%", "100.000ms", "5.00%", "100.000ms", "100.000us", "1000"),
    ("aten::copy_", "0.00%", "50.000us", "0.00%", "50.000us", "5.000us", "10"),
)  # fmt: skip


def _line(cells: tuple[str, ...]) -> str:
    """A row as torch's table prints it: right-aligned cells two spaces apart."""
    return "  ".join([cells[0].rjust(40), *(c.rjust(12) for c in cells[1:])])


RULE = "  ".join(["-" * 40, *(["-" * 12] * 6)])
TABLE = "\n".join([RULE, _line(COLUMNS), RULE, *(_line(r) for r in ROWS), RULE,
                   "Self CPU time total: 2.000s", ""])  # fmt: skip


def test_parse_table_reads_every_row_in_seconds() -> None:
    rows = parse_table(TABLE)
    assert [r[0] for r in rows][:2] == ["_C::onednn_mm", "_C::paged_attention_v1_cpu"]
    assert rows[0][1] == pytest.approx(1.2) and rows[0][2] == 12000
    assert rows[-1] == ("aten::copy_", pytest.approx(50e-6), 10)


def test_phases_sum_and_share() -> None:
    got = phases(parse_table(TABLE))
    assert next(iter(got)) == "linears"
    assert got["linears"]["self_cpu_s"] == pytest.approx(1.2)
    assert got["attention"]["share"] == pytest.approx(0.25, abs=1e-3)
    assert phase_of("cpp_fused_silu_mul_0") == "mlp_act"  # the op it fuses, named, wins
    assert phase_of("aten::copy_") == "other"


def test_bad_cells_and_tables_are_refused() -> None:
    with pytest.raises(ValueError, match="not a time"):
        parse_seconds("12 apples")
    with pytest.raises(ValueError, match="no header"):
        parse_table("nothing here")
