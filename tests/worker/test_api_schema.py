"""The API's schema is kept in the repository: a change to the API shows in review."""

from __future__ import annotations

import json

from tests.conftest import REPO
from worker.api_schema import schema


def test_the_kept_schema_is_the_api_s_own() -> None:
    kept = json.loads((REPO / "docs" / "openapi.json").read_text())
    assert kept == schema(), "stale: python -m worker.api_schema > docs/openapi.json"
    assert set(kept["paths"]) >= {"/v1/runs", "/v1/runs/{name}", "/v1/runs/{name}/approve"}
    # One error shape for every refusal the API documents.
    answers = [a for path in kept["paths"].values() for op in path.values()
               for code, a in op["responses"].items() if code.startswith(("4", "5"))]  # fmt: skip
    assert sum("content" in a for a in answers) >= 10 and all(
        a["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}
        for a in answers
        if "content" in a
    )
