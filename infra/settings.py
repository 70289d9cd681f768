"""Where Forgeline's state lives and how to reach its services.

Resolution order for every setting: an environment variable, then the `stack.json` that
`forgeline up` writes into the state folder, then a default. The state folder itself is
`$FORGELINE_HOME` or `.forgeline/` in the working directory.

Secrets are the exception: the Temporal API key comes only from the environment
(`FORGELINE_TEMPORAL_API_KEY`, or a file named by `FORGELINE_TEMPORAL_API_KEY_FILE`), is never
written to `stack.json` and never shown by a repr. S3 and MLflow credentials stay in the
variables their own clients read (AWS_*, MLFLOW_TRACKING_*); a setting's URL may not carry
them, so no message that names a URL can leak one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from pydantic import SecretStr

from infra.errors import InfraError
from infra.redact import API_KEY_ENV, API_KEY_FILE_ENV, has_credentials, redact_url
from infra.store.factory import open_store
from infra.store.protocol import ObjectStore

STACK_FILE = "stack.json"


class SettingsError(InfraError):
    """A setting is malformed or names something that is not there; the message says which."""


def state_home() -> Path:
    return Path(os.environ.get("FORGELINE_HOME", ".forgeline")).resolve()


_ENV = {
    "temporal_address": "FORGELINE_TEMPORAL_ADDRESS",
    "temporal_namespace": "FORGELINE_TEMPORAL_NAMESPACE",
    "temporal_ui_url": "FORGELINE_TEMPORAL_UI",
    "mlflow_uri": "FORGELINE_MLFLOW_URI",
    "api_url": "FORGELINE_API_URL",
    "store_url": "FORGELINE_STORE",
    "twin_store_url": "FORGELINE_TWIN_STORE",
    "data_roots": "FORGELINE_DATA_ROOTS",
    "node_cache_gb": "FORGELINE_NODE_CACHE_GB",
    "node_warm_standby": "FORGELINE_NODE_WARM_STANDBY",
    "temporal_tls": "FORGELINE_TEMPORAL_TLS",
    "temporal_tls_ca": "FORGELINE_TEMPORAL_TLS_CA",
    "temporal_tls_cert": "FORGELINE_TEMPORAL_TLS_CERT",
    "temporal_tls_key": "FORGELINE_TEMPORAL_TLS_KEY",
    "temporal_tls_server_name": "FORGELINE_TEMPORAL_TLS_SERVER_NAME",
}
# Fields that must never reach stack.json (or any other file Forgeline writes).
SECRET_FIELDS = frozenset({"temporal_api_key"})
_TLS_FILES = ("temporal_tls_ca", "temporal_tls_cert", "temporal_tls_key")
# Where each service's credentials belong instead of its URL.
_CREDENTIALS_GO_TO = {
    "temporal_address": f"{API_KEY_ENV} (or {API_KEY_FILE_ENV})",
    "temporal_ui_url": "your browser's login, not the URL",
    "mlflow_uri": "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN",
    "api_url": "FORGELINE_TOKEN, not the URL",
    "store_url": "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or an AWS profile or role)",
    "twin_store_url": "an AWS profile (?profile=NAME in the URL) or the AWS_* variables",
}
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def setting_label(name: str) -> str:
    """A setting as messages name it: its field and the variable that sets it."""
    return f"{name} ({_ENV[name]})"


@dataclass(frozen=True)
class Settings:
    home: Path
    temporal_address: str = "127.0.0.1:7233"
    temporal_namespace: str = "default"
    temporal_ui_url: str = "http://127.0.0.1:8233"
    mlflow_uri: str = "http://127.0.0.1:5000"
    api_url: str = "http://127.0.0.1:8700"  # Forgeline's HTTP API (`forgeline api`)
    store_url: str = ""
    # A second site (e.g. s3://bucket/prefix?endpoint=URL): committed checkpoints and dataset
    # snapshots are replicated there, and it serves while the primary is down. Empty: none.
    twin_store_url: str = ""
    # TLS to Temporal. None: on exactly when an API key or another TLS option is set
    # (Temporal Cloud takes an API key only over TLS; the local dev server speaks plaintext).
    temporal_tls: bool | None = None
    temporal_tls_ca: str = ""  # a private root CA (PEM); empty: the system's roots
    temporal_tls_cert: str = ""  # client certificate for mTLS (PEM), with temporal_tls_key
    temporal_tls_key: str = ""
    temporal_tls_server_name: str = ""  # the name the server's certificate is checked against
    # SecretStr keeps it out of str() and f-strings and json.dumps refuses it; repr=False keeps
    # it out of the Settings' repr. Only load_settings sets it, from the environment.
    temporal_api_key: SecretStr | None = field(default=None, repr=False)
    # The folders data workers read local `data.sources` from, separated by os.pathsep (':').
    # Empty: only the state folder's `data/` (default_data_roots); `forgeline up` records the
    # folder it was started in as well. The store's own folder is always one.
    data_roots: str = ""
    # The byte budget of each node-local cache (a node agent's datasets, checkpoints and code;
    # the control worker's), in GB (10^9 bytes). None: a quarter of the disk it is on.
    node_cache_gb: float | None = None
    # A node agent keeps a torchrun with torch imported for its next job (trainer.warm_launch):
    # a restart skips those seconds, for the ~300 MB of memory the waiting process holds.
    node_warm_standby: bool = True

    def __post_init__(self) -> None:
        self._check_no_credentials_in_urls()
        self._check_temporal_tls()
        if self.node_cache_gb is not None and not 0 < self.node_cache_gb < float("inf"):
            raise SettingsError(
                f"{setting_label('node_cache_gb')}={self.node_cache_gb!r}: "
                "give a positive number of GB, or unset it (a quarter of the cache's disk)"
            )

    @property
    def store(self) -> str:
        return self.store_url or str(self.home / "store")

    def data_root_folders(self) -> list[str]:
        """Where a data worker may read local sources: the roots set, or the defaults, and the
        store's folder when the store is one (`store:` sources of a local store)."""
        folders = [f for f in self.data_roots.split(os.pathsep) if f]
        folders = folders or default_data_roots(self.home)
        if "://" not in self.store or self.store.startswith("file://"):
            folders.append(self.store.removeprefix("file://"))
        return folders

    def node_cache_bytes(self) -> int | None:
        """The node cache's budget in bytes; None: the default share of its disk."""
        return None if self.node_cache_gb is None else int(self.node_cache_gb * 1e9)

    def open_store(self) -> ObjectStore:
        """The store every process uses: the primary, with its twin when one is set."""
        return open_store(self.store, twin=self.twin_store_url)

    @property
    def temporal_tls_enabled(self) -> bool:
        if self.temporal_tls is not None:
            return self.temporal_tls
        return self.temporal_api_key is not None or any(self._tls_options())

    def _tls_options(self) -> dict[str, str]:
        """The TLS settings that are set (files and server name), by field name."""
        names = (*_TLS_FILES, "temporal_tls_server_name")
        return {name: getattr(self, name) for name in names if getattr(self, name)}

    def _check_no_credentials_in_urls(self) -> None:
        for name, where in _CREDENTIALS_GO_TO.items():
            value = getattr(self, name)
            # Temporal's address is a bare host:port: a scheme lets urlsplit find user info.
            url = f"tcp://{value}" if name == "temporal_address" else value
            if has_credentials(url):
                shown = redact_url(url).removeprefix("tcp://")
                raise SettingsError(
                    f"{setting_label(name)} carries credentials ({shown}): "
                    f"remove them from the URL and put them in {where}"
                )

    def _check_temporal_tls(self) -> None:
        options = ", ".join(map(setting_label, self._tls_options()))
        if self.temporal_tls is False and options:
            raise SettingsError(
                f"{setting_label('temporal_tls')} is off but {options} is set: "
                "turn TLS on or unset them"
            )
        if bool(self.temporal_tls_cert) != bool(self.temporal_tls_key):
            cert, key = setting_label("temporal_tls_cert"), setting_label("temporal_tls_key")
            raise SettingsError(
                f"mTLS needs both {cert} and {key}: "
                "set both (client certificate and its private key) or neither"
            )
        for name in _TLS_FILES:
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise SettingsError(f"{setting_label(name)}: no such file: {path}")

    def save(self) -> Path:
        """Record the stack's addresses so later commands (and node agents) find them."""
        self.home.mkdir(parents=True, exist_ok=True)
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in SECRET_FIELDS}
        data["home"] = str(self.home)
        path = self.home / STACK_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(path)
        return path


def default_data_roots(home: Path) -> list[str]:
    """Where local sources are read from when no roots are set: the state folder's `data/`,
    a folder made to hold corpora. Not the home folder nor /tmp, as before: on a shared host
    they hold the worker's keys and env files and whatever any user leaves in /tmp, and a data
    worker writes what it reads into shards that anyone with the dataset can read. Never empty:
    no roots would confine nothing (dataprep.source_roots.DataRoots)."""
    return [str(home / "data")]


def _parse_bool(env_name: str, raw: str) -> bool:
    word = raw.strip().lower()
    if word in _TRUE | _FALSE:
        return word in _TRUE
    raise SettingsError(f"{env_name}={raw!r} is not a yes/no value: use true or false")


def _parse_gb(env_name: str, raw: object) -> float:
    try:
        return float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise SettingsError(
            f"{env_name}={raw!r} is not a number of GB: use e.g. 500, or unset it "
            "(a quarter of the cache's disk)"
        ) from None


def read_temporal_api_key(environ: Mapping[str, str] | None = None) -> SecretStr | None:
    """The Temporal API key from the environment: the variable itself, or the file it names
    (a mounted secret). Never from stack.json."""
    env = os.environ if environ is None else environ
    direct, key_file = env.get(API_KEY_ENV, ""), env.get(API_KEY_FILE_ENV, "")
    if direct and key_file:
        raise SettingsError(f"set {API_KEY_ENV} or {API_KEY_FILE_ENV}, not both")
    if key_file:
        try:
            direct = Path(key_file).read_text()
        except OSError as err:
            raise SettingsError(
                f"{API_KEY_FILE_ENV}: cannot read {key_file} ({err.strerror or err})"
            ) from None
        if not direct.strip():
            raise SettingsError(f"{API_KEY_FILE_ENV}: {key_file} is empty")
    # A trailing newline from `echo KEY > file` or a secret mount is not part of the key.
    return SecretStr(direct.strip()) if direct.strip() else None


def set_in_environment(name: str) -> str | None:
    """The value the environment gives a setting (not stack.json, not the default)."""
    return os.environ.get(_ENV[name]) or None


def unset_settings(names: list[str], home: Path | None = None) -> list[str]:
    """Of `names`, those neither the environment nor the stack's `stack.json` sets: a process
    on a host of its own would run on the defaults, which name this machine's loopback."""
    stack_file = (home or state_home()).resolve() / STACK_FILE
    recorded = json.loads(stack_file.read_text()) if stack_file.is_file() else {}
    return [name for name in names if not (set_in_environment(name) or recorded.get(name))]


def load_settings(home: Path | None = None) -> Settings:
    home = (home or state_home()).resolve()
    recorded: dict[str, object] = {}
    stack_file = home / STACK_FILE
    if stack_file.is_file():
        recorded = json.loads(stack_file.read_text())
    values: dict[str, object] = {}
    for name, env_name in _ENV.items():
        value = os.environ.get(env_name) or recorded.get(name)
        if value is None or value == "":
            continue
        if name in ("temporal_tls", "node_warm_standby") and isinstance(value, str):
            value = _parse_bool(env_name, value)
        if name == "node_cache_gb":
            value = _parse_gb(env_name, value)
        values[name] = value
    return Settings(home=home, temporal_api_key=read_temporal_api_key(), **values)
