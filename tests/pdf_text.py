"""Read a PDF's text with pdftotext (poppler-utils), shared by the invoice tests.

A new user's machine may lack poppler-utils: then the PDF checks are left out. CI
installs it and sets ``KVTOLL_REQUIRE_SERVICES=1``, where its absence is a failure, so
a missing tool can never quietly turn the PDF checks off there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def pdf_text(pdf: Path) -> str | None:
    """The text of ``pdf``, or ``None`` where pdftotext is not installed (outside CI)."""
    if shutil.which("pdftotext") is None:
        if os.environ.get("KVTOLL_REQUIRE_SERVICES") == "1":
            pytest.fail("pdftotext (poppler-utils) is required here; .ci/run installs it")
        return None
    return subprocess.run(
        ["pdftotext", str(pdf), "-"], capture_output=True, text=True, check=True
    ).stdout
