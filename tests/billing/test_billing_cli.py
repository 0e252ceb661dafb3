from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner, Result

from billing import keys
from billing.cli import register
from billing.schema import SCHEMA_REVISION


def _app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


@pytest.fixture
def cli(sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("KVTOLL_DATABASE_URL", sqlite_url)
    return CliRunner()


def _run(runner: CliRunner, *args: str) -> Result:
    return runner.invoke(_app(), list(args))


def _ok(runner: CliRunner, *args: str) -> Result:
    result = _run(runner, *args)
    assert result.exit_code == 0, result.output
    return result


def _dump(url: str) -> str:
    with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
        return "\n".join(conn.iterdump())


def _assert_refused(runner: CliRunner, url: str, *args: str, match: str) -> None:
    before = _dump(url)
    result = _run(runner, *args)
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
    assert match in result.stderr
    assert result.stdout == ""
    assert _dump(url) == before


def test_commands_before_upgrade_fail_without_creating_a_database(
    cli: CliRunner, sqlite_url: str
) -> None:
    result = _run(cli, "tenant", "list")
    assert result.exit_code == 2 and "kvtoll db upgrade" in result.stderr
    assert not Path(sqlite_url.removeprefix("sqlite:///")).exists()


def test_db_upgrade_current_and_downgrade(cli: CliRunner, sqlite_url: str) -> None:
    head = SCHEMA_REVISION
    assert f"database at {head}" in _ok(cli, "db", "upgrade").stdout
    assert _ok(cli, "db", "current").stdout.strip() == f"current {head} head {head}"
    _assert_refused(cli, sqlite_url, "db", "downgrade", match="--yes")
    _assert_refused(cli, sqlite_url, "db", "upgrade", "--revision", "nope", match="nope")
    assert "database at base" in _ok(cli, "db", "downgrade", "--yes").stdout
    assert _ok(cli, "db", "current").stdout.strip() == f"current base head {head}"
    _ok(cli, "db", "upgrade")
    _ok(cli, "tenant", "create", "acme")


def test_tenant_commands_and_their_bad_input(cli: CliRunner, sqlite_url: str) -> None:
    _ok(cli, "db", "upgrade")
    assert "tenant acme created" in _ok(cli, "tenant", "create", "acme").stdout
    _ok(cli, "tenant", "create", "beta")
    listing = _ok(cli, "tenant", "list").stdout.splitlines()
    assert listing[0].split("\t")[:2] == ["id", "name"]
    assert [line.split("\t")[1] for line in listing[1:]] == ["acme", "beta"]
    _assert_refused(cli, sqlite_url, "tenant", "create", "acme", match="already exists")
    _assert_refused(cli, sqlite_url, "tenant", "create", "ACME", match="names ignore case")
    _assert_refused(cli, sqlite_url, "tenant", "create", "bad name", match="invalid tenant")


def test_key_commands_print_the_key_once(cli: CliRunner, sqlite_url: str) -> None:
    _ok(cli, "db", "upgrade")
    _ok(cli, "tenant", "create", "acme")
    created = _ok(cli, "key", "create", "acme", "--name", "ci", "--rpm", "60")
    lines = created.stdout.splitlines()
    key_id = lines[0].removeprefix("key_id ")
    plaintext = lines[1].removeprefix("key ")
    assert keys.check_key_id(key_id) and keys.check_format(plaintext)
    assert created.output.count(plaintext) == 1
    listing = _ok(cli, "key", "list", "acme").stdout
    assert key_id in listing and keys.display_prefix(plaintext) in listing
    assert plaintext[4:-6] not in listing
    assert listing.splitlines()[1].split("\t")[-1] == "-"  # not revoked
    assert "revoked" in _ok(cli, "key", "revoke", key_id).stdout
    revoked_at = _ok(cli, "key", "list", "acme").stdout.splitlines()[1].split("\t")[-1]
    assert revoked_at.startswith("20")


def test_key_bad_input(cli: CliRunner, sqlite_url: str) -> None:
    _ok(cli, "db", "upgrade")
    _ok(cli, "tenant", "create", "acme")
    key_id = _ok(cli, "key", "create", "acme").stdout.splitlines()[0].removeprefix("key_id ")
    _ok(cli, "key", "revoke", key_id)
    _assert_refused(cli, sqlite_url, "key", "create", "nobody", match="unknown tenant")
    _assert_refused(cli, sqlite_url, "key", "list", "nobody", match="unknown tenant")
    _assert_refused(cli, sqlite_url, "key", "revoke", "key_typo", match="malformed key id")
    _assert_refused(cli, sqlite_url, "key", "revoke", key_id, match="already revoked")
    _assert_refused(
        cli, sqlite_url, "key", "revoke", keys.generate_key_id(), match="unknown key id"
    )
    _assert_refused(cli, sqlite_url, "key", "create", "acme", "--rpm", "0", match="positive")


PRICE = ("--input", "0.15", "--cached-input", "0.075", "--output", "0.6")


def test_price_set_and_list(cli: CliRunner) -> None:
    _ok(cli, "db", "upgrade")
    _ok(cli, "price", "set", "smol", *PRICE, "--semantic-fraction", "0.1",
        "--effective-from", "2026-01-01T00:00:00")
    _ok(cli, "price", "set", "smol", "--input", "0.3", "--cached-input", "0.15",
        "--output", "1.2", "--semantic-fraction", "0.2", "--effective-from", "2026-02-01T00:00Z")
    rows = [line.split("\t") for line in _ok(cli, "price", "list").stdout.splitlines()]
    assert rows[0] == ["model", "input", "cached_input", "output", "semantic_fraction",
                       "effective"]
    assert rows[1] == ["smol", "0.15", "0.075", "0.6", "0.1", "2026-01-01T00:00:00+00:00"]
    assert rows[2] == ["smol", "0.3", "0.15", "1.2", "0.2", "2026-02-01T00:00:00+00:00"]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("--input", "-0.15", "--cached-input", "0", "--output", "1", "--semantic-fraction",
          "0.1"), "must not be negative"),
        (("--input", "cheap", "--cached-input", "0", "--output", "1", "--semantic-fraction",
          "0.1"), "decimal number"),
        (("--input", "1", "--cached-input", "0", "--output", "NaN", "--semantic-fraction",
          "0.1"), "finite"),
        ((*PRICE, "--semantic-fraction", "1.01"), "between 0 and 1"),
        ((*PRICE, "--semantic-fraction", "-0.5"), "between 0 and 1"),
        ((*PRICE, "--semantic-fraction", "half"), "decimal number"),
        ((*PRICE, "--semantic-fraction", "0.1", "--effective-from", "tomorrow"), "ISO 8601"),
        ((*PRICE, "--semantic-fraction", "0.1", "--effective-from", "2026-01-01"),
         "already has a price"),
    ],
)
def test_price_bad_input(
    cli: CliRunner, sqlite_url: str, args: tuple[str, ...], match: str
) -> None:
    _ok(cli, "db", "upgrade")
    _ok(cli, "price", "set", "smol", *PRICE, "--semantic-fraction", "0.1",
        "--effective-from", "2026-01-01T00:00:00+00:00")
    _assert_refused(cli, sqlite_url, "price", "set", "smol", *args, match=match)


@pytest.mark.parametrize("migrated_url", ["postgres"], indirect=True)
def test_cli_on_postgres(migrated_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTOLL_DATABASE_URL", migrated_url)
    runner = CliRunner()
    assert f"database at {SCHEMA_REVISION}" in _ok(runner, "db", "upgrade").stdout
    _ok(runner, "tenant", "create", "acme")
    result = _run(runner, "tenant", "create", "acme")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "acme" in _ok(runner, "tenant", "list").stdout


def test_root_cli_includes_the_billing_groups(cli: CliRunner) -> None:
    from kvtoll.cli.main import build_app

    app = build_app()
    assert cli.invoke(app, ["db", "upgrade"]).exit_code == 0
    result = cli.invoke(app, ["tenant", "create", "acme"])
    assert result.exit_code == 0, result.output
    assert cli.invoke(app, ["tenant", "create", "acme"]).exit_code == 2


def test_tenant_policy_updates_only_the_given_fields(cli: CliRunner, sqlite_url: str) -> None:
    _ok(cli, "db", "upgrade")
    _ok(cli, "tenant", "create", "acme")
    _ok(cli, "tenant", "policy", "acme", "--semantic-threshold", "0.9", "--allow-sampled")
    _ok(cli, "tenant", "policy", "acme", "--kv-reserved-blocks", "64")
    row = _ok(cli, "tenant", "list").stdout.splitlines()[1].split("\t")
    assert row[1:2] + row[3:] == ["acme", "0.9", "True", "64", "-", "-", "-", "0.02"]
    _ok(cli, "tenant", "policy", "acme", "--default-threshold", "--no-allow-sampled")
    row = _ok(cli, "tenant", "list").stdout.splitlines()[1].split("\t")
    assert row[3:] == ["-", "False", "64", "-", "-", "-", "0.02"]
    _ok(cli, "tenant", "policy", "acme", "--kv-reserved-blocks", "32", "--kv-max-blocks", "100",
        "--semantic-max-entries", "500", "--semantic-max-bytes", "1000000")
    row = _ok(cli, "tenant", "list").stdout.splitlines()[1].split("\t")
    assert row[5:] == ["32", "100", "500", "1000000", "0.02"]
    _ok(cli, "tenant", "policy", "acme", "--semantic-max-error-rate", "0.05")
    row = _ok(cli, "tenant", "list").stdout.splitlines()[1].split("\t")
    assert row[5:] == ["32", "100", "500", "1000000", "0.05"]
    _ok(cli, "tenant", "policy", "acme", "--kv-max-blocks", "none")
    assert _ok(cli, "tenant", "list").stdout.splitlines()[1].split("\t")[6] == "-"
    for args, match in [
        (("--semantic-threshold", "1.5"), "[0, 1]"),
        (("--semantic-threshold", "high"), "must be a number"),
        (("--semantic-threshold", "nan"), "finite"),
        (("--kv-reserved-blocks", "-1"), "in 0.."),
        (("--kv-reserved-blocks", str(2**31)), "in 0.."),
        (("--kv-reserved-blocks", "many"), "must be a number"),
        (("--kv-reserved-blocks", "64", "--kv-max-blocks", "10"), "at least kv_reserved"),
        (("--kv-max-blocks", "-3"), "kv_max_blocks must be in"),
        (("--semantic-max-entries", "0"), "positive integer"),
        (("--semantic-max-error-rate", "0"), "(0, 1)"),
        (("--semantic-max-error-rate", "1"), "(0, 1)"),
        (("--semantic-max-error-rate", "-0.5"), "(0, 1)"),
        (("--semantic-max-error-rate", "nan"), "finite"),
        (("--semantic-max-error-rate", "often"), "must be a number"),
    ]:
        _assert_refused(cli, sqlite_url, "tenant", "policy", "acme", *args, match=match)
    _assert_refused(cli, sqlite_url, "tenant", "policy", "nobody", match="unknown tenant")
    _assert_refused(cli, sqlite_url, "tenant", "policy", "nobody",
                    "--semantic-max-error-rate", "0.05", match="unknown tenant")
    _assert_refused(cli, sqlite_url, "key", "create", "acme", "--tpm", "lots", match="number")


def test_key_revoke_help_states_the_revocation_bound(cli: CliRunner) -> None:
    """The help says when a revoked key stops working, and that is the gateways' key
    cache lifetime (not "immediately")."""
    from proxy.config import ProxyConfig

    text = " ".join(_ok(cli, "key", "revoke", "--help").stdout.split())
    assert "immediately" not in text
    assert f"within {keys.REVOCATION_BOUND_S} s" in text
    assert ProxyConfig().auth_cache_ttl_s == keys.REVOCATION_BOUND_S


def test_upgrade_refuses_tenant_names_that_clash_in_case(cli: CliRunner, sqlite_url: str) -> None:
    _ok(cli, "db", "upgrade", "--revision", "0002")
    with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as conn:
        for name in ("acme", "ACME", "Beta", "beta", "gamma"):
            conn.execute("INSERT INTO tenants (name, created_at, semantic_allow_sampled, "
                         "kv_reserved_blocks) VALUES (?, '2026-01-01', 0, 0)", (name,))
    _assert_refused(cli, sqlite_url, "db", "upgrade", match="ACME, acme; Beta, beta")
    assert _ok(cli, "db", "current").stdout.strip() == f"current 0002 head {SCHEMA_REVISION}"


def test_price_set_refuses_a_model_the_gateway_does_not_serve(
    cli: CliRunner, sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtoll.served_models import record_served_models

    _ok(cli, "db", "upgrade")
    data_dir = tmp_path / "data"
    monkeypatch.setenv("KVTOLL_DATA_DIR", str(data_dir))
    price = ("--input", "0.15", "--cached-input", "0.075", "--output", "0.6",
             "--semantic-fraction", "0.1")
    unchecked = _ok(cli, "price", "set", "anything", *price)  # no gateway recorded models
    assert unchecked.stderr.startswith("warning: cannot check")
    record_served_models(data_dir, ["SmolLM2-135M-Instruct.Q4_1", "other"])
    _assert_refused(cli, sqlite_url, "price", "set", "SmolLM2-135M-Instruct", *price,
                    match="served: SmolLM2-135M-Instruct.Q4_1, other")
    assert _ok(cli, "price", "set", "SmolLM2-135M-Instruct.Q4_1", *price).stderr == ""
    _ok(cli, "price", "set", "SmolLM2-135M-Instruct", *price, "--force")
    assert "SmolLM2-135M-Instruct\t" in _ok(cli, "price", "list").stdout
