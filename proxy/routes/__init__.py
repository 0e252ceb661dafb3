"""Thin HTTP routes of the gateway: parse → call a service → render."""
