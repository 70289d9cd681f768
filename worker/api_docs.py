"""The API's `/docs`: a plain page of its requests, made from its own schema, with no script.

FastAPI's Swagger UI and ReDoc pages load their scripts from a CDN, and this origin is the one
whose page (/) keeps the reader's token in its storage: a script from elsewhere, or a CDN that
served another one, could read it. Their assets are not installed with FastAPI, so instead the
API serves this page, which runs nothing and loads nothing (its CSP says so), and links the
schema itself: /openapi.json, kept in the repository as docs/openapi.json.
"""

from __future__ import annotations

import html

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

DOCS_PATH = "/docs"
# No script, no frame, nothing fetched: only the page's own inline style.
DOCS_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
}
_METHODS = ("get", "post", "put", "patch", "delete")
_STYLE = (
    "body{font:14px/1.5 system-ui,sans-serif;margin:2em;max-width:70em}"
    "td{padding:.3em .8em;vertical-align:top;border-top:1px solid #ddd}"
    "code{font-size:13px}"
)


def add_docs(app: FastAPI) -> None:
    """Serve the page at /docs (build the app with docs_url=None and redoc_url=None)."""

    @app.get(DOCS_PATH, response_class=HTMLResponse, include_in_schema=False)
    async def docs() -> HTMLResponse:
        return HTMLResponse(docs_page(app.openapi()), headers=DOCS_HEADERS)


def docs_page(schema: dict) -> str:
    info = schema.get("info", {})
    rows = "".join(
        f"<tr><td><code>{html.escape(method.upper())}</code></td>"
        f"<td><code>{html.escape(path)}</code></td><td>{html.escape(_summary(operation))}</td></tr>"
        for path, operations in schema.get("paths", {}).items()
        for method, operation in operations.items()
        if method in _METHODS
    )
    title = html.escape(f"{info.get('title', '')} API {info.get('version', '')}")
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        f"<style>{_STYLE}</style></head><body><h1>{title}</h1>"
        f"<p>{html.escape(info.get('description', ''))}</p>"
        '<p>The schema: <a href="/openapi.json">/openapi.json</a> (OpenAPI 3; kept in '
        "Forgeline's repository as <code>docs/openapi.json</code>). Every request but this page "
        "and the cluster page carries <code>Authorization: Bearer &lt;token&gt;</code>; every "
        'refusal is <code>{"error": {"code", "message", "field", "fix"}}</code>.</p>'
        f"<table>{rows}</table></body></html>"
    )


def _summary(operation: dict) -> str:
    """The first paragraph of the operation's description, else FastAPI's summary."""
    description = operation.get("description", "").split("\n\n")[0]
    return " ".join(description.split()) or operation.get("summary", "")
