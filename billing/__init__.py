"""Billing: tenants, API keys, prices, the usage ledger and invoices, in SQL.

Layers (each imports only those below it)::

    cli.py                     kvtoll db|tenant|key|price (one-line errors, exit 2)
    accounts.py pricing.py     services on a Session; flush, the caller commits
    ledger.py                  write_usage: rate + INSERT .. ON CONFLICT DO NOTHING
    rating.py                  pure: (usage, price) -> Charge, exact integers
    keys.py money.py errors.py pure helpers: key format/hash, Decimal <-> picodollars
    db.py migrate.py models.py engine/session factories, Alembic, the schema
"""
