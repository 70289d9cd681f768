"""Print the HTTP API's OpenAPI schema, as `forgeline api` serves it at /openapi.json:

    python -m worker.api_schema > docs/openapi.json

The repository keeps it (docs/openapi.json) so that a change to the API shows in review, and a
test checks that the served schema is still the kept one.
"""

from __future__ import annotations

import json
from pathlib import Path

from infra.settings import Settings
from worker.api import make_app


def schema() -> dict:
    # The schema depends on no setting: any state folder will do, and none is touched.
    return make_app(Settings(home=Path("/nonexistent"))).openapi()


if __name__ == "__main__":
    print(json.dumps(schema(), indent=2, sort_keys=True))
