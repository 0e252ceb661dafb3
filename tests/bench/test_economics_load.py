"""bench.economics_load on tiny synthetic trace and pairs files: shared hash ids give
shared prompt prefixes, paraphrases share a question class, look-alikes do not."""

from __future__ import annotations

import json
import random
from pathlib import Path

from bench.economics_load import (
    LoadConfig,
    PlannedRequest,
    build_load,
    chunk_text,
    interleave,
    q_requests,
)


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config(tmp_path: Path, **overrides: object) -> LoadConfig:
    trace = write_jsonl(tmp_path / "trace.jsonl", [
        {"timestamp": 0, "hash_ids": [0, 1, 2]},
        {"timestamp": 1, "hash_ids": [0, 1, 2, 3]},
        {"timestamp": 2, "hash_ids": [0, 1, 4]},
        {"timestamp": 3, "hash_ids": [0, 9, 8]},  # a session of one turn: left out
    ])
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [
        {"text_a": f"dup question {i}?", "text_b": f"reworded question {i}?", "label": 1}
        for i in range(4)
    ] + [{"text_a": f"how tall is {i}?", "text_b": f"how old is {i}?", "label": 0}
         for i in range(3)])
    values: dict[str, object] = {"trace": trace, "pairs": pairs, "p_requests": 10,
                                 "duplicates": 3, "negatives": 2, "repeats": 2}
    values.update(overrides)
    return LoadConfig(**values)  # type: ignore[arg-type]


def test_prefix_tenant_prompts_share_the_text_of_shared_hash_ids(tmp_path: Path) -> None:
    load = [r for r in build_load(config(tmp_path)) if r.tenant == "P"]
    texts = [r.messages[-1][1] for r in load]
    assert [r.question_class for r in load] == ["p:0,1,2", "p:0,1,2,3", "p:0,1,4"]
    assert texts[1].startswith(texts[0])
    shared = "Context:" + chunk_text(0, 6) + chunk_text(1, 6)
    assert texts[2].startswith(shared) and not texts[2].startswith(texts[0])
    assert chunk_text(5, 6) == chunk_text(5, 6) != chunk_text(6, 6)


def test_paraphrase_tenant_asks_text_a_first_then_paraphrases_repeats_and_look_alikes(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path)
    pairs = [json.loads(line) for line in cfg.pairs.read_text().splitlines()]
    load = q_requests(cfg, pairs)
    questions = [r.messages[-1][1] for r in load]
    assert len(load) == 3 + 2 + 3 + 2 + 2  # text_a of every pair, text_b, 2 repeats
    first, later = questions[:5], questions[5:]
    assert all(q.startswith(("dup", "how tall")) for q in first)
    assert sum(q.startswith("reworded") for q in later) == 3
    assert sum(q in first for q in later) == 2  # the exact repeats
    cls = {q: r.question_class for q, r in zip(questions, load, strict=True)}
    for i in range(4):
        if f"reworded question {i}?" in cls:
            assert cls[f"reworded question {i}?"] == cls[f"dup question {i}?"]
    for i in range(3):
        if f"how old is {i}?" in cls:
            assert cls[f"how old is {i}?"] != cls[f"how tall is {i}?"]
    assert all(r.max_tokens == cfg.q_max_tokens and r.messages[0][0] == "system" for r in load)


def test_interleave_keeps_each_tenants_order() -> None:
    a = [PlannedRequest("P", (("user", f"a{i}"),), f"a{i}", 1) for i in range(7)]
    b = [PlannedRequest("Q", (("user", f"b{i}"),), f"b{i}", 1) for i in range(5)]
    merged = interleave(a, b, random.Random(3))
    assert [r for r in merged if r.tenant == "P"] == a
    assert [r for r in merged if r.tenant == "Q"] == b
    assert merged != a + b


def test_same_seed_same_load(tmp_path: Path) -> None:
    assert build_load(config(tmp_path)) == build_load(config(tmp_path))
    assert build_load(config(tmp_path)) != build_load(config(tmp_path, seed=5))
