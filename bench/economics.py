"""What the caches are worth to a tenant (issue 23 item 6): billed vs list vs perfect.

One real ``kvtoll serve`` (the CLI in a process of its own: the in-process engine
serving the bundled SmolLM2-135M-Instruct, the semantic cache as shipped, a fresh
PostgreSQL database as the ledger, migrated here and dropped at the end) takes a mixed
load from two tenants, one request at a time, temperature 0
(:mod:`bench.economics_load`): P sends prefix-sharing requests built from the Mooncake
conversation trace, Q sends QQP questions, then their paraphrases (label 1), exact
repeats and label-0 look-alikes. The ledger is then read with SQL: per tenant, list
price and billed amount, beside what perfect caches would bill at the same prices for
the same token counts (:mod:`bench.economics_accounting`: every prefix already sent
billed as cached, in whole KV blocks; every paraphrase or repeat of a complete answer
billed as a semantic hit). Reported per tenant and in total: ``savings_fraction_of_perfect``
(actual savings / perfect savings), semantic hits, the cacheable requests served from
the cache, wrong semantic hits (count and share of hits) and the missing savings by
layer; and (``--no-diagnose`` skips it) the requests replayed through a fresh semantic
cache (:mod:`bench.economics_diagnose`), which names the L3 stage that turned each missed
paraphrase away (embedding: no candidate; verifier: candidates rejected). Goal (issue
23): >= 0.95 of perfect savings, wrong hits <= 2% of semantic hits. Prints one JSON
object; ``--out FILE`` also writes it.

    export $(/work/shared/tools/ensure-services.sh | xargs)   # KVTOLL_TEST_DATABASE_URL
    PYTHONPATH=. .venv/bin/python bench/economics.py --out bench/figures/issue23_economics.json
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as ``python bench/economics.py``: the repo root, for
    # bench.*, in place of bench/ itself (whose kernels.py would shadow the ``kernels``
    # package that transformers imports for the embedder)
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import httpx
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from bench.economics_accounting import Joined, LedgerRow, SentRequest, join, report
from bench.economics_diagnose import replay_semantic
from bench.economics_load import LoadConfig, PlannedRequest, build_load
from bench.emit import emit

DATA = Path("/work/shared/data")
BLOCK_SIZE = 16  # the engine's default KV block (``kvtoll serve`` does not change it)
TENANTS = {"P": "econ-prefix", "Q": "econ-paraphrase"}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Ledger:
    """A fresh PostgreSQL database on ``base_url``'s server: migrated, two tenants with
    a key each and one price; dropped by :meth:`drop`."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.name = f"kvtoll_econ_{uuid.uuid4().hex[:12]}"
        self.url = make_url(base_url).set(database=self.name).render_as_string(
            hide_password=False)

    def create(self, model: str, prices: tuple[str, str, str, str]) -> dict[str, str]:
        """Create, migrate and seed the database; the plaintext key of each tenant."""
        admin = create_engine(self.base_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{self.name}"'))
        admin.dispose()
        from billing import accounts, migrate, pricing
        from billing.db import make_engine, session_factory

        migrate.upgrade(self.url)
        engine = make_engine(self.url)
        keys: dict[str, str] = {}
        with session_factory(engine).begin() as s:
            for label, name in TENANTS.items():
                accounts.create_tenant(s, name)
                _, keys[label] = accounts.create_key(
                    s, name, requests_per_minute=1_000_000, tokens_per_minute=1_000_000_000)
            pricing.set_price(s, model, *prices)
        engine.dispose()
        return keys

    def rows(self, expected: int, timeout_s: float = 60.0) -> list[LedgerRow]:
        """Every ledger row with its tenant's name, once ``expected`` rows are in (the
        outbox drains in the background) or ``timeout_s`` passed."""
        sql = text("SELECT u.request_id, t.name, u.served_by, u.prompt_tokens, u.cached_tokens,"
                   " u.completion_tokens, u.billed_pico, u.list_pico FROM usage_ledger u"
                   " JOIN tenants t ON t.id = u.tenant_id ORDER BY u.id")
        engine = create_engine(self.url)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                with engine.connect() as conn:
                    found = conn.execute(sql).all()
                if len(found) >= expected or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        finally:
            engine.dispose()
        names = {v: k for k, v in TENANTS.items()}
        return [LedgerRow(str(r[0]), names.get(str(r[1]), str(r[1])), str(r[2]), int(r[3]),
                          int(r[4]), int(r[5]), int(r[6]), int(r[7])) for r in found]

    def sql_totals(self) -> dict[str, dict[str, int]]:
        """Billed and list per tenant, summed by the database."""
        sql = text("SELECT t.name, count(*), sum(u.list_pico), sum(u.billed_pico),"
                   " sum(CASE WHEN u.served_by = 'semantic' THEN 1 ELSE 0 END)"
                   " FROM usage_ledger u JOIN tenants t ON t.id = u.tenant_id GROUP BY t.name")
        engine = create_engine(self.url)
        try:
            with engine.connect() as conn:
                found = conn.execute(sql).all()
        finally:
            engine.dispose()
        names = {v: k for k, v in TENANTS.items()}
        return {names.get(str(r[0]), str(r[0])): {"rows": int(r[1]), "list_pico": int(r[2]),
                                        "billed_pico": int(r[3]), "semantic_rows": int(r[4])}
                for r in found}

    def price(self) -> Any:
        from billing.rating import PriceQuote

        engine = create_engine(self.url)
        try:
            with engine.connect() as conn:
                r = conn.execute(text("SELECT input_pico, cached_input_pico, output_pico,"
                                      " semantic_hit_ppm FROM prices")).one()
        finally:
            engine.dispose()
        return PriceQuote(int(r[0]), int(r[1]), int(r[2]), int(r[3]))

    def drop(self) -> None:
        admin = create_engine(self.base_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)'))
        admin.dispose()


class Gateway:
    """``kvtoll serve`` (in-process engine, semantic cache on) in a process of its own."""

    def __init__(self, database_url: str, workdir: Path) -> None:
        self.port = _free_port()
        self.log = workdir / "gateway.log"
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "KVTOLL_DATABASE_URL": database_url, "KVTOLL_DATA_DIR": str(workdir / "data"),
               "KVTOLL_SECRET": secrets.token_urlsafe(24),
               "KVTOLL_ADMIN_TOKEN": secrets.token_urlsafe(24),
               "KVTOLL_LOG_LEVEL": "warning", "KVTOLL_REDIS_URL": ""}
        args = [sys.executable, "-c", "from kvtoll.cli.main import main; main()", "serve",
                "--port", str(self.port)]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=log)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        tail = self.log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"the gateway did not become ready:\n{tail}")

    def model(self, key: str) -> str:
        resp = httpx.get(self.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def send_all(gateway: Gateway, keys: dict[str, str], model: str,
             load: list[PlannedRequest], tokenizer: Any) -> list[SentRequest]:
    """Every planned request, one at a time, as the tenant's client would send it."""
    sent: list[SentRequest] = []
    with httpx.Client(base_url=gateway.url, timeout=600) as client:
        for planned in load:
            resp = client.post("/v1/chat/completions", json=planned.body(model),
                               headers={"Authorization": f"Bearer {keys[planned.tenant]}"})
            if resp.status_code != 200:
                raise RuntimeError(f"gateway answered {resp.status_code}: {resp.text[:500]}")
            choice = resp.json()["choices"][0]
            prompt = tuple(tokenizer.apply_chat_template(planned.message_dicts()))
            sent.append(SentRequest(
                resp.headers["x-kvtoll-request-id"], planned.tenant, prompt,
                planned.question_class, resp.headers.get("x-kvtoll-cache", ""),
                choice.get("finish_reason"), choice["message"].get("content") or ""))
    return sent


def semantic_detail(load: list[PlannedRequest], sent: list[SentRequest], joined: list[Joined],
                    replayed: dict[str, str]) -> list[dict[str, Any]]:
    """Each request perfect caches would serve from the semantic cache, or that was: its
    question, class, how it was served, whether the hit was wrong, and the replayed
    lookup's reason (:mod:`bench.economics_diagnose`)."""
    text_of = {s.request_id: p.messages[-1][1][:120] for p, s in zip(load, sent, strict=True)}
    return [{"tenant": j.sent.tenant, "question": text_of[j.sent.request_id],
             "class": j.sent.question_class, "cache": j.sent.cache,
             "perfect_semantic": j.ideal.semantic, "repeat": j.ideal.repeat,
             "wrong_hit": j.wrong_hit, "replayed_l3": replayed.get(j.sent.request_id)}
            for j in joined if j.ideal.semantic or j.sent.cache == "semantic"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.api.tokenizers import tokenizer_from_path
    from engine.loader.bundled import bundled_model_path

    model_path = bundled_model_path()
    tokenizer = tokenizer_from_path(model_path)
    config = LoadConfig(
        trace=Path(args.trace), pairs=Path(args.pairs), p_requests=args.p_requests,
        max_ids=args.max_ids, words_per_id=args.words_per_id, p_max_tokens=args.p_max_tokens,
        duplicates=args.duplicates, negatives=args.negatives, repeats=args.repeats,
        q_max_tokens=args.q_max_tokens, seed=args.seed,
    )
    load = build_load(config)
    prices = (args.input_price, args.cached_input_price, args.output_price,
              args.semantic_fraction)
    ledger = Ledger(args.database_url)
    keys = ledger.create(model_path.stem, prices)
    began = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="kvtoll-econ-") as work:
            gateway = Gateway(ledger.url, Path(work))
            try:
                gateway.wait_ready()
                started = time.perf_counter()
                model = gateway.model(keys["P"])
                sent = send_all(gateway, keys, model, load, tokenizer)
                load_s = time.perf_counter() - started
                rows = ledger.rows(len(sent))
            finally:
                gateway.close()
        joined, missing = join(sent, rows, BLOCK_SIZE, ledger.price())
        mismatched = sum(len(j.sent.prompt_ids) != j.row.prompt_tokens for j in joined)
        summary, totals = report(joined), ledger.sql_totals()
        replayed: dict[str, str] = {}
        if args.diagnose:
            try:  # a diagnosis only: its failure must not lose the ledger's figures
                replayed, summary["semantic_replay"] = replay_semantic(load, sent, joined, model)
            except Exception as exc:
                summary["semantic_replay"] = {"error": f"{type(exc).__name__}: {exc}"}
        summary["sql_totals_match"] = all(
            summary["tenants"][t][k] == totals[t][k] for t in totals
            for k in ("list_pico", "billed_pico")) and set(totals) == set(summary["tenants"])
        out: dict[str, Any] = {
            "config": {k: v for k, v in vars(args).items() if k not in ("out", "database_url")},
            "model": model, "block_size": BLOCK_SIZE,
            "prices_per_1m": dict(zip(("input", "cached_input", "output",
                                       "semantic_hit_fraction"), prices, strict=True)),
            "requests_sent": len(sent), "ledger_rows": len(rows),
            "requests_without_ledger_row": len(missing),
            "prompt_token_count_mismatches": mismatched,
            "load_s": round(load_s, 1), "wall_s": round(time.perf_counter() - began, 1),
            "ledger_sql_totals": totals,
            **summary,
            "semantic_requests": semantic_detail(load, sent, joined, replayed),
            "goal": {"savings_fraction_of_perfect_at_least": 0.95,
                     "wrong_semantic_hit_share_at_most": 0.02},
        }
    finally:
        ledger.drop()
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--database-url", default=os.environ.get("KVTOLL_TEST_DATABASE_URL", ""),
                   help="a PostgreSQL server URL; a fresh database is made on it "
                        "(default: KVTOLL_TEST_DATABASE_URL)")
    p.add_argument("--trace", default=str(DATA / "mooncake_conversation_trace.jsonl"))
    p.add_argument("--pairs", default=str(DATA / "qqp_pairs_clean_40k.jsonl"))
    p.add_argument("--p-requests", type=int, default=40, help="tenant P's requests")
    p.add_argument("--max-ids", type=int, default=32, help="trace hash ids per request, at most")
    p.add_argument("--words-per-id", type=int, default=6, help="words of text per hash id")
    p.add_argument("--p-max-tokens", type=int, default=4)
    p.add_argument("--duplicates", type=int, default=15, help="tenant Q's label-1 pairs")
    p.add_argument("--negatives", type=int, default=5, help="tenant Q's label-0 pairs")
    p.add_argument("--repeats", type=int, default=8, help="label-1 text_a asked again")
    p.add_argument("--q-max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-price", default="1", help="USD per 1M input tokens")
    p.add_argument("--cached-input-price", default="0.5")
    p.add_argument("--output-price", default="4")
    p.add_argument("--semantic-fraction", default="0.1")
    p.add_argument("--no-diagnose", dest="diagnose", action="store_false",
                   help="skip replaying the requests through a fresh semantic cache")
    p.add_argument("--out", default="", help="also write the JSON object to this file")
    args = p.parse_args(argv)
    if not args.database_url.startswith("postgresql"):
        p.error("--database-url (or KVTOLL_TEST_DATABASE_URL) must be a PostgreSQL URL")
    if args.repeats > args.duplicates:
        p.error("--repeats must not exceed --duplicates")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = run(args)
    emit(out, args.out)


if __name__ == "__main__":
    main()
