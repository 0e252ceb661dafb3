"""The official ``openai`` SDK, unmodified, against the gateway served by uvicorn
(with a scripted upstream; the engine-backed end-to-end run is in test_engine_e2e)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from sqlalchemy.orm import Session, sessionmaker

from billing.models import RequestStatus, ServedBy
from kvtoll.settings import Settings
from tests.proxy.helpers import MODEL, LiveServer, Tenants, build_app, settled_rows
from tests.proxy.scripted import ScriptedUpstream


@pytest.fixture
def server(settings: Settings, db: sessionmaker[Session], tenants: Tenants) -> Iterator[LiveServer]:
    app = build_app(settings, db, upstreams=[ScriptedUpstream(num_words=4)])
    with LiveServer(app) as live:
        yield live


@pytest.fixture
def client(server: LiveServer, tenants: Tenants) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=tenants.key_a, max_retries=0)


def test_chat_and_headers(
    client: openai.OpenAI, db: sessionmaker[Session], tenants: Tenants
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=10
    )
    chat = raw.parse()
    assert chat.choices[0].message.content == "word0 word1 word2 word3 "
    assert chat.choices[0].finish_reason == "stop"
    assert chat.usage is not None and chat.usage.completion_tokens == 4
    assert chat.usage.prompt_tokens_details is not None
    assert chat.usage.prompt_tokens_details.cached_tokens == 0
    assert raw.headers["x-kvtoll-cache"] == "miss"
    assert raw.headers["x-kvtoll-worker"] == "scripted-0"
    [row] = settled_rows(db, 1)
    assert row.request_id == raw.headers["x-kvtoll-request-id"]
    assert (row.tenant_id, row.api_key_id) == (tenants.tenant_a, tenants.key_a_id)
    assert (row.status, row.served_by) == (RequestStatus.OK, ServedBy.ENGINE)
    assert (row.prompt_tokens, row.completion_tokens) == (7, 4)
    # price: 1 USD / 1M input, 2 USD / 1M output -> 7 * 1e6 + 4 * 2e6 picodollars
    assert row.billed_pico == 7_000_000 + 8_000_000


def test_completion_max_tokens_length(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="once upon", max_tokens=2)
    assert out.choices[0].text == "word0 word1 "
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 2


def test_streaming_with_usage(client: openai.OpenAI, db: sessionmaker[Session]) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "word0 word1 word2 word3 "
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == 7 + 4
    assert [r.completion_tokens for r in settled_rows(db, 1)] == [4]


def test_streaming_completions_without_usage(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="x", stream=True))
    assert all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == "word0 word1 word2 word3 "


def test_n_choices(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage is not None and out.usage.completion_tokens == 8


def test_model_list(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_sdk_errors(server: LiveServer, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="kvt_wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
