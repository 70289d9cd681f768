"""The API's /docs runs no script and loads nothing from elsewhere: this origin's cluster page
keeps a token (worker/api_docs.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from infra.settings import Settings
from tests.asgi_call import call
from worker.api import make_app


def test_docs_is_a_plain_page_with_no_script(tmp_path: Path) -> None:
    app = make_app(Settings(home=tmp_path))
    page = asyncio.run(call(app, "GET", "/docs"))
    assert page.status == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src" not in policy
    text = page.body.decode()
    assert "<script" not in text.lower() and "://" not in text  # nothing from any origin
    assert 'href="/openapi.json"' in text and "<code>/v1/runs/{name}/approve</code>" in text
    assert "A train.code folder as a tar of its files" in text  # the requests' own words
    # FastAPI's CDN pages are gone, and the schema is still served.
    for path in ("/redoc", "/docs/oauth2-redirect"):
        assert asyncio.run(call(app, "GET", path)).status == 404, path
    assert asyncio.run(call(app, "GET", "/openapi.json")).json()["info"]["title"] == "Forgeline"
