"""HTML rendering shared by the dashboards: Jinja2 templates, headers, static files.

Templates autoescape everything; pages carry a strict Content-Security-Policy
(scripts and styles only from this server, so chart data travels as inert JSON).
Static files are served from the package's ``static/`` folder through a fixed
whitelist built at start-up (no path from the request ever reaches the disk).
"""

from __future__ import annotations

import mimetypes
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import FileResponse, HTMLResponse, Response
from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup

from billing.money import display_usd, usd_to_pico

WEB_DIR = Path(__file__).resolve().parent
STATIC_DIR = WEB_DIR / "static"
TEMPLATE_DIR = WEB_DIR / "templates"
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
        " object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def template_environment() -> Environment:
    """The Jinja2 environment for ``web/templates`` (build once per app)."""
    env = Environment(
        loader=FileSystemLoader(TEMPLATE_DIR),
        autoescape=select_autoescape(["html"]),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["num"] = format_count
    env.filters["usd"] = format_usd_html
    return env


def format_count(value: int) -> str:
    """A count with thousands separators (``1,234,567``)."""
    return f"{value:,}"


def format_usd_html(exact: str) -> Markup:
    """An exact USD string (:func:`billing.money.exact_usd`) shown to the cent (or to 4
    significant digits under a cent), the exact figure in its tooltip and ``data-exact``."""
    shown = display_usd(usd_to_pico(exact))
    return Markup('<span class="usd" title="{0} USD" data-exact="{0}">{1}</span>').format(
        exact, shown)


def render_page(env: Environment, name: str, status: int = 200, **context: Any) -> HTMLResponse:
    """Render ``name`` with security headers."""
    html = env.get_template(name).render(**context)
    return HTMLResponse(html, status_code=status, headers=PAGE_HEADERS)


STATIC_SUFFIXES = frozenset({".css", ".js", ".txt"})


def static_files() -> dict[str, Path]:
    """Relative name -> file for the CSS, JS and licence files under ``web/static``."""
    return {
        path.relative_to(STATIC_DIR).as_posix(): path
        for path in STATIC_DIR.rglob("*")
        if path.is_file() and path.suffix in STATIC_SUFFIXES
    }


def add_static_route(router: APIRouter, prefix: str) -> None:
    """Serve ``web/static`` at ``{prefix}/{name}`` from a whitelist."""
    files = static_files()

    @router.get(prefix + "/{name:path}", include_in_schema=False)
    def static(name: str) -> Response:
        path = files.get(name)
        if path is None:
            return Response("not found", status_code=404, media_type="text/plain")
        media_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        return FileResponse(
            path, media_type=media_type,
            headers={"Cache-Control": "public, max-age=3600", "X-Content-Type-Options": "nosniff"},
        )
