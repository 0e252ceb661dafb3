"""Static files come from the package through a whitelist; Chart.js is vendored, no CDN."""

from __future__ import annotations

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from kvtoll.settings import Settings
from web.app import create_web_app
from web.pages import STATIC_DIR, template_environment


def test_static_whitelist(sqlite_web_factory: sessionmaker[Session], settings: Settings) -> None:
    client = TestClient(create_web_app(settings, sqlite_web_factory))
    chart = client.get("/dashboard/static/vendor/chart.umd.min.js")
    assert chart.status_code == 200 and "Chart.js v4" in chart.text[:200]
    assert chart.headers["content-type"].startswith(("text/javascript", "application/javascript"))
    assert client.get("/admin/static/kvtoll.css").status_code == 200
    for name in ("../app.py", "..%2Fapp.py", "vendor/../../app.py", "__init__.py", "nope.js"):
        assert client.get(f"/dashboard/static/{name}").status_code == 404
    assert (STATIC_DIR / "vendor" / "chart.js-LICENSE.txt").read_text().startswith("The MIT")


def test_templates_load_nothing_from_other_sites() -> None:
    env = template_environment()
    for name in env.list_templates(extensions=["html"]):
        source = env.loader.get_source(env, name)[0]  # type: ignore[union-attr]
        assert "http://" not in source and "https://" not in source, name
