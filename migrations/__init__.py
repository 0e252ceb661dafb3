"""Alembic migrations for the billing schema; run them with :mod:`billing.migrate`."""
