"""Bad requests are refused with EngineRejected naming the parameter, before anything
runs; the engine serves the next request normally."""

from __future__ import annotations

import math

import pytest

from engine.api import EngineRejected, GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.factory import LoadedModel, build_llm_engine

OK = (10, 11, 12)


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ((), SamplingParams(), "prompt"),
        (tuple(range(3, 259)) * 2, SamplingParams(max_tokens=1), "prompt"),  # 512 > 256 context
        (OK, SamplingParams(max_tokens=300), "max_tokens"),
        (OK, SamplingParams(max_tokens=0), "max_tokens"),
        (OK, SamplingParams(n=9), "n"),
        (OK, SamplingParams(n=0), "n"),
        (OK, SamplingParams(temperature=-0.1), "temperature"),
        (OK, SamplingParams(temperature=math.nan), "temperature"),
        (OK, SamplingParams(top_p=0.0), "top_p"),
        (OK, SamplingParams(top_p=1.5), "top_p"),
        (OK, SamplingParams(top_p=math.nan), "top_p"),
        (OK, SamplingParams(top_k=-1), "top_k"),
        (OK, SamplingParams(logprobs=99), "logprobs"),
        ((5, 100_000), SamplingParams(), "prompt"),
    ],
)
def test_bad_request_is_refused(
    tiny_model: LoadedModel, prompt: tuple[int, ...], params: SamplingParams, param: str
) -> None:
    engine = build_llm_engine(EngineConfig.tiny(max_n=8), tiny_model)
    with pytest.raises(EngineRejected, match=f"^{param}: ") as info:
        engine.add_request(GenerationRequest("bad", prompt, params))
    assert isinstance(info.value, ValueError)
    assert not engine.has_unfinished()
    out = engine.generate_sync([GenerationRequest("good", OK, SamplingParams(max_tokens=3))])
    assert out["good"][0][-1].completion_tokens >= 1
