"""Every command's numeric options, fed out-of-range values, end in one ``error:`` line
and exit code 2, with no traceback and the database unchanged.

Each case runs in-process through the real root CLI (:func:`kvtoll.cli.main.run`,
what the ``kvtoll`` script calls) on one migrated SQLite database per module.
:func:`test_every_numeric_option_is_covered` reads the command tree, so a numeric
option added later without a case here fails the suite.
"""

from __future__ import annotations

import sqlite3
import types
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer

from kvtoll.cli.main import build_app, run

INT_BAD = ("-1", "99999999999999999999", "abc", "1.5")
FLOAT_BAD = ("-1", "nan", "inf", "1e400", "99999999999999999999", "abc")
UNBOUNDED_INT_BAD = ("-1", "abc", "1.5")  # an option where any large count is meaningful

# command line (with valid required arguments) -> numeric option -> values it refuses
TRACE = __file__  # any file: every value below is refused before it is read
CASES: dict[tuple[str, ...], dict[str, tuple[str, ...]]] = {
    ("serve",): {"--port": ("-1", "65536", "99999999999999999999", "abc")},
    ("worker", "--model", "kvtoll-tiny", "--port", "0"): {
        "--port": ("-1", "65536", "99999999999999999999", "abc"),
        "--block-size": INT_BAD, "--num-blocks": INT_BAD, "--kv-cache-mb": INT_BAD,
        "--gpu-memory-utilization": FLOAT_BAD, "--max-model-len": INT_BAD,
        "--max-num-seqs": INT_BAD, "--max-batched-tokens": INT_BAD, "--max-n": INT_BAD,
        "--max-body-mb": FLOAT_BAD, "--heartbeat-ttl": FLOAT_BAD, "--kv-tier-mb": INT_BAD,
    },
    ("tenant", "policy", "acme"): {
        "--semantic-threshold": FLOAT_BAD, "--kv-reserved-blocks": INT_BAD,
        "--semantic-max-error-rate": FLOAT_BAD,
    },
    ("key", "create", "acme"): {"--rpm": INT_BAD, "--tpm": INT_BAD},
    ("price", "set", "m", "--input", "1", "--cached-input", "0.5", "--output", "2",
     "--semantic-fraction", "0.1", "--force"): {
        "--input": FLOAT_BAD, "--cached-input": FLOAT_BAD, "--output": FLOAT_BAD,
        "--semantic-fraction": FLOAT_BAD,
    },
    ("budget", "set", "acme", "--monthly-usd", "10"): {
        "--monthly-usd": FLOAT_BAD, "--alert-at": FLOAT_BAD,
    },
    ("bench", "semantic", "--pairs", TRACE): {
        "--threshold": FLOAT_BAD, "--limit": UNBOUNDED_INT_BAD, "--candidates": INT_BAD,
    },
    ("bench", "semantic", "--stream", "--pairs", TRACE): {
        "--max-error-rate": FLOAT_BAD, "--explore-rate": FLOAT_BAD, "--repeat-rate": FLOAT_BAD,
        "--seed": UNBOUNDED_INT_BAD,
    },
    ("bench", "routing", "--trace", TRACE): {
        "--workers": INT_BAD, "--cache-tokens": UNBOUNDED_INT_BAD, "--block-size": INT_BAD,
        "--prefill-tokens-per-s": FLOAT_BAD, "--limit": UNBOUNDED_INT_BAD,
    },
}
# Numeric arguments (not options): command line before the value.
ARGUMENT_CASES: dict[tuple[str, ...], tuple[str, ...]] = {
    ("invoice", "export"): ("-1", "0", "99999999999999999999", "abc"),
}
ARGUMENT_TAILS = {("invoice", "export"): ("--format", "json", "-o", "out.json")}


def _cases() -> Iterator[tuple[list[str], str]]:
    for prefix, options in CASES.items():
        for option, values in options.items():
            for value in values:
                yield [*prefix, option, value], f"{' '.join(prefix[:2])} {option}={value}"
    for prefix, values in ARGUMENT_CASES.items():
        for value in values:
            yield [*prefix, value, *ARGUMENT_TAILS[prefix]], f"{' '.join(prefix)} {value}"


ALL_CASES = list(_cases())


def _dump(path: Path) -> str:
    with sqlite3.connect(path) as conn:
        return "\n".join(conn.iterdump())


@pytest.fixture(scope="module")
def database(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A migrated database with the tenant ``acme`` (module-wide: cases change nothing)."""
    path = tmp_path_factory.mktemp("cli") / "kvtoll.db"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVTOLL_DATABASE_URL", f"sqlite:///{path}")
        assert run(["db", "upgrade"]) == 0
        assert run(["tenant", "create", "acme"]) == 0
    yield path


@pytest.mark.parametrize(("argv", "label"), ALL_CASES, ids=[label for _, label in ALL_CASES])
def test_out_of_range_value_is_one_error_line_and_exit_2(
    argv: list[str], label: str, database: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("KVTOLL_DATABASE_URL", f"sqlite:///{database}")
    monkeypatch.setenv("KVTOLL_DEV_MODE", "1")
    monkeypatch.setenv("KVTOLL_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    before = _dump(database)
    capsys.readouterr()
    code = run(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (label, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), (label, err)
    assert "Traceback" not in err and out == ""
    assert _dump(database) == before
    assert not (tmp_path / "out.json").exists()


def _numeric(annotation: object) -> bool:
    if annotation in (int, float):
        return True
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return any(_numeric(arg) for arg in typing.get_args(annotation))
    return False


Path_ = tuple[str, ...]


def _commands(group: object, path: Path_ = ()) -> Iterator[tuple[Path_, object]]:
    for name, sub in getattr(group, "commands", {}).items():
        if hasattr(sub, "commands"):
            yield from _commands(sub, (*path, name))
        else:
            yield (*path, name), sub


def test_every_numeric_option_is_covered() -> None:
    """Each int/float option of every command has cases above (string options that hold
    numbers, like the billing ones, are listed by hand)."""
    root = typer.main.get_command(build_app())
    covered = {(prefix[:2] if prefix[0] in ("tenant", "key", "price", "budget", "bench")
                else prefix[:1], option)
               for prefix, options in CASES.items() for option in options}
    missing = []
    for path, command in _commands(root):
        for param in command.params:  # type: ignore[attr-defined]
            annotation = param.type_descriptor.annotation
            if param.param_type_name == "option" and _numeric(annotation):
                key = (path, param.opts[0])
                if key not in covered:
                    missing.append(key)
            elif (param.param_type_name == "argument" and _numeric(annotation)
                  and path not in ARGUMENT_CASES):
                missing.append((path, param.name))
    assert missing == []
