"""bench.share_accounting on the tiny model: both sides run the same workload, the ON
side really applies the share (the pool then knows the tenant's reservation)."""

from __future__ import annotations

import pytest

from bench import share_accounting
from engine.config import EngineConfig
from engine.factory import build_llm_engine, load_model


def test_on_and_off_interleaved_with_ratio_and_spread() -> None:
    config = EngineConfig.tiny(num_kv_blocks=64, max_model_len=256)
    loaded = load_model(config)
    prompts = [[5 + i, 6, 7, 8] * 8 for i in range(4)]
    out = share_accounting.share_accounting_cost(loaded, config, prompts, [4] * 4, repeats=2)
    assert out["pairs"] == 2
    assert len(out["on_output_tokens_per_s"]) == len(out["off_output_tokens_per_s"]) == 2
    assert out["pair_ratio_min"] <= out["on_vs_off"] * 1.5
    assert out["on_vs_off"] == pytest.approx(out["on_median"] / out["off_median"], rel=1e-2)
    best = max(out["on_output_tokens_per_s"]) / max(out["off_output_tokens_per_s"])
    assert out["on_vs_off_best"] == pytest.approx(best, rel=1e-2)
    assert out["pair_ratio_min"] <= out["pair_ratio_median"] <= out["pair_ratio_max"]


def test_on_side_sets_the_tenant_reservation(monkeypatch: pytest.MonkeyPatch) -> None:
    config = EngineConfig.tiny(num_kv_blocks=64, max_model_len=256)
    loaded = load_model(config)
    engines = []

    def keep(cfg: EngineConfig, model: object) -> object:
        engine = build_llm_engine(cfg, loaded)
        engines.append(engine)
        return engine

    monkeypatch.setattr(share_accounting, "build_llm_engine", keep)
    share_accounting.share_accounting_cost(loaded, config, [[9, 8, 7] * 8], [2], repeats=1)
    off, on = engines
    assert not off.kv.pool.tenants.any_reserved
    assert on.kv.pool.tenants.get(share_accounting.SALT).share.reserved_blocks == 32


def test_repeats_must_be_positive() -> None:
    config = EngineConfig.tiny(num_kv_blocks=16, max_model_len=64)
    with pytest.raises(ValueError, match="repeats"):
        share_accounting.share_accounting_cost(load_model(config), config, [[1]], [1], 0)
