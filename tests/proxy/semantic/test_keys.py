from __future__ import annotations

from proxy.semantic.keys import CacheKey, NotCacheable, build_cache_key
from tests.proxy.semantic.semantic_helpers import chat


def key(body: dict[str, object], tenant: str = "t1", **kw: bool) -> CacheKey:
    result = build_cache_key(tenant, body, **kw)
    assert isinstance(result, CacheKey), result
    return result


def test_only_the_last_user_turn_is_embedded() -> None:
    history = ({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
               {"role": "assistant", "content": "hello"})  # fmt: skip
    assert key(chat("tell me more", *history)).query == "tell me more"


def test_partition_covers_tenant_model_params_and_history() -> None:
    base = key(chat("What is Rust?"))
    assert key(chat("Something else entirely")).partition == base.partition
    variants = [
        key(chat("What is Rust?"), tenant="t2"),
        key(chat("What is Rust?", model="other")),
        key(chat("What is Rust?", max_tokens=5)),
        key(chat("What is Rust?", top_p=0.5)),
        key(chat("What is Rust?", n=2)),
        key(chat("What is Rust?", tools=[{"type": "function", "function": {"name": "f"}}])),
        key(chat("What is Rust?", response_format={"type": "json_object"})),
        key(chat("What is Rust?", {"role": "system", "content": "answer in French"})),
        key(
            chat(
                "What is Rust?",
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
            )
        ),
    ]
    partitions = {v.partition for v in variants} | {base.partition}
    assert len(partitions) == len(variants) + 1


def test_stream_and_user_fields_do_not_split_partitions() -> None:
    assert key(chat("q", stream=True, user="u1")).partition == key(chat("q")).partition


def test_sampling_needs_opt_in_and_absent_temperature_means_one() -> None:
    sampled = chat("What is Rust?", temperature=0.7)
    assert isinstance(build_cache_key("t", sampled), NotCacheable)
    assert isinstance(build_cache_key("t", sampled, allow_sampled=True), CacheKey)
    no_temp = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
    assert isinstance(build_cache_key("t", no_temp), NotCacheable)
    assert isinstance(build_cache_key("t", no_temp, default_temperature=0.0), CacheKey)


def test_not_cacheable_shapes() -> None:
    tool_turn = chat("q")
    tool_turn["messages"] = [{"role": "tool", "content": "42", "tool_call_id": "c"}]
    image = chat("q")
    image["messages"] = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    ]
    for body in (tool_turn, image, {"model": "m", "temperature": 0, "messages": []}, chat("   ")):
        assert isinstance(build_cache_key("t", body), NotCacheable)


def test_completion_prompt_and_text_parts() -> None:
    assert key({"model": "m", "temperature": 0, "prompt": "Say hi"}).query == "Say hi"
    parts = chat("x")
    parts["messages"] = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert key(parts).query == "a\nb"
