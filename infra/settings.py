"""Where Forgeline's state lives and how to reach its services.

Resolution order for every setting: an environment variable, then the `stack.json` that
`forgeline up` writes into the state folder, then a default. The state folder itself is
`$FORGELINE_HOME` or `.forgeline/` in the working directory.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

STACK_FILE = "stack.json"


def state_home() -> Path:
    return Path(os.environ.get("FORGELINE_HOME", ".forgeline")).resolve()


@dataclass(frozen=True)
class Settings:
    home: Path
    temporal_address: str = "127.0.0.1:7233"
    temporal_namespace: str = "default"
    temporal_ui_url: str = "http://127.0.0.1:8233"
    mlflow_uri: str = "http://127.0.0.1:5000"
    store_url: str = ""

    @property
    def store(self) -> str:
        return self.store_url or str(self.home / "store")

    def save(self) -> Path:
        """Record the stack's addresses so later commands (and node agents) find them."""
        self.home.mkdir(parents=True, exist_ok=True)
        data = asdict(self)
        data["home"] = str(self.home)
        path = self.home / STACK_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(path)
        return path


_ENV = {
    "temporal_address": "FORGELINE_TEMPORAL_ADDRESS",
    "temporal_namespace": "FORGELINE_TEMPORAL_NAMESPACE",
    "temporal_ui_url": "FORGELINE_TEMPORAL_UI",
    "mlflow_uri": "FORGELINE_MLFLOW_URI",
    "store_url": "FORGELINE_STORE",
}


def load_settings(home: Path | None = None) -> Settings:
    home = (home or state_home()).resolve()
    recorded: dict[str, str] = {}
    stack_file = home / STACK_FILE
    if stack_file.is_file():
        recorded = json.loads(stack_file.read_text())
    values = {}
    for field, env_name in _ENV.items():
        value = os.environ.get(env_name) or recorded.get(field)
        if value:
            values[field] = value
    return Settings(home=home, **values)
