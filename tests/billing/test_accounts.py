from __future__ import annotations

from datetime import UTC, datetime
from typing import NoReturn

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from billing import accounts, keys
from billing.errors import Conflict, InvalidInput, NotFound
from billing.models import ApiKey, Tenant

Factory = sessionmaker[Session]


class ExplodingSession:
    """Stands in for a session that must not be touched: any use fails the test."""

    def __getattr__(self, name: str) -> NoReturn:
        raise AssertionError(f"database touched: session.{name}")


def _tenant_count(factory: Factory) -> int:
    with factory() as session:
        return session.scalar(select(func.count()).select_from(Tenant)) or 0


def test_create_and_list_tenants(factory: Factory) -> None:
    with factory.begin() as session:
        accounts.create_tenant(session, "zeta")
        accounts.create_tenant(session, "acme")
    with factory() as session:
        assert [t.name for t in accounts.list_tenants(session)] == ["acme", "zeta"]
        acme = accounts.get_tenant_by_name(session, "acme")
        assert acme is not None and acme.created_at.tzinfo is not None
        assert accounts.get_tenant_by_name(session, "nobody") is None
        with pytest.raises(NotFound):
            accounts.require_tenant(session, "nobody")


def test_duplicate_tenant_is_a_conflict_and_writes_nothing(factory: Factory) -> None:
    with factory.begin() as session:
        accounts.create_tenant(session, "acme")
    with pytest.raises(Conflict), factory.begin() as session:
        accounts.create_tenant(session, "acme")
    assert _tenant_count(factory) == 1


def test_tenant_names_are_unique_ignoring_case(factory: Factory) -> None:
    with factory.begin() as session:
        accounts.create_tenant(session, "acme")
    for other in ("ACME", "Acme"):
        with pytest.raises(Conflict, match="ignore case"), factory.begin() as session:
            accounts.create_tenant(session, other)
    with factory() as session:
        found = accounts.get_tenant_by_name(session, "ACME")
        assert found is not None and found.name == "acme"
    # the database itself refuses, whatever the application checks
    with pytest.raises(IntegrityError), factory.begin() as session:
        session.add(Tenant(name="AcMe", created_at=datetime.now(UTC),
                           semantic_allow_sampled=False, kv_reserved_blocks=0))
    assert _tenant_count(factory) == 1


@pytest.mark.parametrize("name", ["", "-acme", "a b", "x" * 65, "ac/me", "ac\nme"])
def test_invalid_tenant_names_are_refused(sqlite_factory: Factory, name: str) -> None:
    with pytest.raises(InvalidInput), sqlite_factory.begin() as session:
        accounts.create_tenant(session, name)
    assert _tenant_count(sqlite_factory) == 0


def test_key_create_use_and_revoke(factory: Factory) -> None:
    with factory.begin() as session:
        tenant = accounts.create_tenant(session, "acme")
        row, plaintext = accounts.create_key(
            session, "acme", "ci", requests_per_minute=60, tokens_per_minute=1000
        )
        key_id = row.id
    assert keys.check_format(plaintext)
    assert row.display_prefix == keys.display_prefix(plaintext)
    with factory() as session:
        identity = accounts.resolve_key(session, plaintext)
    assert identity is not None
    assert identity.key_id == key_id
    assert (identity.tenant_id, identity.tenant_name) == (tenant.id, "acme")
    assert (identity.requests_per_minute, identity.tokens_per_minute) == (60, 1000)
    assert identity.kv_reserved_blocks == 0 and identity.semantic_allow_sampled is False
    with factory.begin() as session:
        revoked = accounts.revoke_key(session, key_id)
        assert revoked.revoked_at is not None
    with factory() as session:
        assert accounts.resolve_key(session, plaintext) is None
        [listed] = accounts.list_keys(session, "acme")
        assert listed.id == key_id and listed.revoked_at is not None


def test_revocation_errors(factory: Factory) -> None:
    with factory.begin() as session:
        accounts.create_tenant(session, "acme")
        row, _ = accounts.create_key(session, "acme")
        accounts.revoke_key(session, row.id)
    with factory() as session:
        with pytest.raises(Conflict):
            accounts.revoke_key(session, row.id)
        with pytest.raises(InvalidInput):
            accounts.revoke_key(session, "key_typo")
        with pytest.raises(NotFound):
            accounts.revoke_key(session, keys.generate_key_id())


def test_key_errors_for_unknown_tenant_and_bad_limits(factory: Factory) -> None:
    with factory.begin() as session:
        accounts.create_tenant(session, "acme")
    with factory() as session:
        with pytest.raises(NotFound):
            accounts.create_key(session, "nobody")
        with pytest.raises(NotFound):
            accounts.list_keys(session, "nobody")
        with pytest.raises(InvalidInput):
            accounts.create_key(session, "acme", requests_per_minute=0)
        with pytest.raises(InvalidInput):  # past the 32-bit column: refused, not a DataError
            accounts.create_key(session, "acme", tokens_per_minute=3_000_000_000)
        # A name no tenant can have (PostgreSQL refuses NUL in text) is simply unknown.
        assert accounts.get_tenant_by_name(session, "a\x00b") is None
        with pytest.raises(NotFound):
            accounts.list_keys(session, "a\x00b")
        session.rollback()
        assert session.scalar(select(func.count()).select_from(ApiKey)) == 0


def test_typo_is_refused_before_any_lookup(factory: Factory) -> None:
    with factory.begin() as session:
        accounts.create_tenant(session, "acme")
        _, plaintext = accounts.create_key(session, "acme")
    position = 10
    other = "A" if plaintext[position] != "A" else "B"
    typo = plaintext[:position] + other + plaintext[position + 1 :]
    for bad in (typo, plaintext[:-1], plaintext + "x", "sk-" + plaintext[4:], ""):
        assert accounts.resolve_key(ExplodingSession(), bad) is None  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="database touched"):
        accounts.resolve_key(ExplodingSession(), plaintext)  # type: ignore[arg-type]


def test_well_formed_but_unknown_key_resolves_to_none(factory: Factory) -> None:
    with factory() as session:
        assert accounts.resolve_key(session, keys.generate_key()) is None


def test_tenant_policy_reaches_the_key_identity(factory: Factory) -> None:
    with factory.begin() as session:
        accounts.create_tenant(session, "acme")
        _, plaintext = accounts.create_key(session, "acme")
        accounts.set_tenant_policy(
            session, "acme", semantic_threshold=0.92, semantic_allow_sampled=True,
            kv_reserved_blocks=128, kv_max_blocks=256, semantic_max_entries=10,
            semantic_max_bytes=4096,
        )
    with factory() as session:
        identity = accounts.resolve_key(session, plaintext)
        assert identity is not None
        assert identity.semantic_threshold == pytest.approx(0.92)
        assert identity.semantic_allow_sampled is True and identity.kv_reserved_blocks == 128
        assert (identity.kv_max_blocks, identity.semantic_max_entries) == (256, 10)
        assert identity.semantic_max_bytes == 4096
        for threshold, blocks in ((1.5, 0), (0.5, -1)):
            with pytest.raises(InvalidInput):
                accounts.set_tenant_policy(
                    session, "acme", semantic_threshold=threshold,
                    semantic_allow_sampled=False, kv_reserved_blocks=blocks,
                )
