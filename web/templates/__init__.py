"""Package data (web/templates): shipped in the wheel through pyproject's package-data patterns."""
