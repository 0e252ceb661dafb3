"""Package data (web/static): shipped in the wheel through pyproject's package-data patterns."""
