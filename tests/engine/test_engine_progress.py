"""A sequence's progress has one writer, the scheduler: no other engine module assigns
it, and an engine step (model, sampling, finish checks) leaves it to
``Scheduler.update_from_output``, which refuses progress that moved elsewhere."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import engine
from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.factory import LoadedModel, build_llm_engine
from engine.scheduler import SchedulerOutput

PROGRESS = {"num_computed_tokens", "num_cached_tokens"}
WRITER = "scheduler.py"
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def _progress_writes(path: Path) -> list[int]:
    """Lines that assign, augment, setattr or pass as a keyword a progress field."""
    lines: list[int] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call):
            if any(k.arg in PROGRESS for k in node.keywords):
                lines.append(node.lineno)
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and name.value in PROGRESS:
                lines.append(node.lineno)  # setattr(seq, "num_computed_tokens", ...)
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr in PROGRESS:
                lines.append(node.lineno)
    return lines


def test_only_the_scheduler_writes_progress() -> None:
    root = Path(engine.__file__).parent
    writers = {
        str(p.relative_to(root)): lines
        for p in sorted(root.rglob("*.py"))
        if (lines := _progress_writes(p))
    }
    assert set(writers) == {WRITER}, writers


def _req(rid: str, n_prompt: int) -> GenerationRequest:
    return GenerationRequest(rid, tuple(3 + (i * 5) % 100 for i in range(n_prompt)), GREEDY)


def test_an_engine_step_leaves_progress_to_the_scheduler(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefix hit is counted by the scheduler's step, not by the KV manager at
    admission; runner, sampling and finish checks move nothing until the scheduler's
    update_from_output runs."""
    engine = build_llm_engine(EngineConfig.tiny(), tiny_model)
    bs = engine.block_size
    engine.generate_sync([_req("warm", 40)])  # caches the prompt's full blocks
    engine.add_request(_req("r", 40))
    (seq,) = engine._requests["r"]
    out = engine.scheduler.schedule()
    (s,) = out.scheduled
    assert (s.start, s.num_new_tokens, s.completes) == (40 // bs * bs, 40 % bs, True)
    assert seq.num_computed_tokens == 0  # adopting the prefix wrote no progress

    accounted: list[SchedulerOutput] = []
    monkeypatch.setattr(engine.scheduler, "update_from_output", accounted.append)
    engine.execute(out)
    assert accounted == [out]
    assert seq.num_output_tokens == 1  # the engine appended the sampled token...
    assert seq.num_computed_tokens == 0  # ...and moved no progress
    monkeypatch.undo()

    engine.scheduler.update_from_output(out)
    assert seq.num_computed_tokens == 40
    assert seq.num_cached_tokens == 40 // bs * bs


def test_update_from_output_refuses_progress_moved_elsewhere(tiny_model: LoadedModel) -> None:
    engine = build_llm_engine(EngineConfig.tiny(), tiny_model)
    engine.add_request(_req("r", 10))
    out = engine.scheduler.schedule()
    (s,) = out.scheduled
    s.seq.num_computed_tokens = s.start + s.num_new_tokens  # what the engine step once did
    with pytest.raises(RuntimeError, match="progress moved outside the scheduler"):
        engine.scheduler.update_from_output(out)


def test_preemption_resets_progress_inside_schedule(tiny_model: LoadedModel) -> None:
    """Only the preempted sequence loses its progress, in the step that preempts it."""
    engine = build_llm_engine(
        EngineConfig.tiny(num_kv_blocks=4, max_num_batched_tokens=64), tiny_model
    )
    bs = engine.block_size
    long = SamplingParams(max_tokens=2 * bs, temperature=0.0, ignore_eos=True)
    engine.add_request(GenerationRequest("old", tuple(range(3, 3 + bs + 1)), long))
    engine.add_request(GenerationRequest("young", tuple(range(50, 50 + bs + 1)), long))
    engine.step()  # both prefill: 2 blocks each, the pool is full
    old, young = engine._requests["old"][0], engine._requests["young"][0]
    while not engine.num_preemptions:
        before = old.num_computed_tokens
        out = engine.scheduler.schedule()
        if out.preempted:
            assert out.preempted == (young,)
            assert young.num_computed_tokens == 0 and young.num_preemptions == 1
            assert old.num_computed_tokens == before  # scheduled, not yet advanced
        engine.execute(out)
    assert old.num_computed_tokens == old.num_tokens - 1
