"""Package data (web/static/vendor): shipped in the wheel through pyproject's package-data patterns."""
