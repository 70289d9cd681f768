"""Settings: the Temporal TLS options resolve and fail clearly; secrets stay out of stack.json,
reprs and URLs; redaction masks what it must and nothing else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.redact import known_secrets, redact_text, redact_url
from infra.settings import Settings, SettingsError, load_settings

API_KEY = "tmprl-api-key-0123456789abcdef"
ALL_ENV = (
    "FORGELINE_TEMPORAL_ADDRESS",
    "FORGELINE_TEMPORAL_NAMESPACE",
    "FORGELINE_TEMPORAL_UI",
    "FORGELINE_MLFLOW_URI",
    "FORGELINE_STORE",
    "FORGELINE_TEMPORAL_TLS",
    "FORGELINE_TEMPORAL_TLS_CA",
    "FORGELINE_TEMPORAL_TLS_CERT",
    "FORGELINE_TEMPORAL_TLS_KEY",
    "FORGELINE_TEMPORAL_TLS_SERVER_NAME",
    "FORGELINE_TEMPORAL_API_KEY",
    "FORGELINE_TEMPORAL_API_KEY_FILE",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
)


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A clean environment: none of the machine's own settings or credentials leak in."""
    for name in ALL_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def pem(tmp_path: Path) -> Path:
    path = tmp_path / "ca.pem"
    path.write_text("-----BEGIN CERTIFICATE-----\n...\n-----END CERTIFICATE-----\n")
    return path


def test_the_api_key_comes_from_the_environment_and_never_reaches_stack_json(
    env: pytest.MonkeyPatch, tmp_path: Path, pem: Path
) -> None:
    env.setenv("FORGELINE_TEMPORAL_API_KEY", API_KEY)
    env.setenv("FORGELINE_TEMPORAL_TLS_CA", str(pem))
    settings = load_settings(tmp_path)
    assert settings.temporal_api_key is not None
    assert settings.temporal_api_key.get_secret_value() == API_KEY
    stack = settings.save().read_text()
    assert API_KEY not in stack
    assert "temporal_api_key" not in json.loads(stack)
    assert json.loads(stack)["temporal_tls_ca"] == str(pem)  # not secret: kept
    for shown in (repr(settings), str(settings), f"{settings}", repr(settings.temporal_api_key)):
        assert API_KEY not in shown
    # A stack.json that somehow holds a key is not where keys come from.
    (tmp_path / "stack.json").write_text(json.dumps({"temporal_api_key": API_KEY}))
    env.delenv("FORGELINE_TEMPORAL_API_KEY")
    assert load_settings(tmp_path).temporal_api_key is None


def test_the_api_key_can_come_from_a_file(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text(f"{API_KEY}\n")  # a secret mount's trailing newline is not the key
    env.setenv("FORGELINE_TEMPORAL_API_KEY_FILE", str(key_file))
    settings = load_settings(tmp_path)
    assert settings.temporal_api_key is not None
    assert settings.temporal_api_key.get_secret_value() == API_KEY
    assert settings.temporal_tls_enabled  # Temporal Cloud takes an API key only over TLS
    assert API_KEY in known_secrets()  # so redaction masks a key that never was in os.environ


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"FORGELINE_TEMPORAL_API_KEY_FILE": "/no/such/key"}, "cannot read /no/such/key"),
        (
            {"FORGELINE_TEMPORAL_API_KEY": API_KEY, "FORGELINE_TEMPORAL_API_KEY_FILE": "/k"},
            "not both",
        ),
        ({"FORGELINE_TEMPORAL_TLS": "maybe"}, "FORGELINE_TEMPORAL_TLS='maybe' is not a yes/no"),
        (
            {"FORGELINE_TEMPORAL_TLS_CA": "/no/such/ca.pem"},
            r"temporal_tls_ca \(FORGELINE_TEMPORAL_TLS_CA\): no such file: /no/such/ca.pem",
        ),
        ({"FORGELINE_TEMPORAL_TLS_CERT": "{pem}"}, "needs both .*CERT.* and .*KEY"),
        ({"FORGELINE_TEMPORAL_TLS_KEY": "{pem}"}, "needs both .*CERT.* and .*KEY"),
        (
            {"FORGELINE_TEMPORAL_TLS": "false", "FORGELINE_TEMPORAL_TLS_CA": "{pem}"},
            "is off but temporal_tls_ca",
        ),
    ],
)
def test_bad_temporal_settings_are_one_clear_line(
    env: pytest.MonkeyPatch, tmp_path: Path, pem: Path, variables: dict[str, str], message: str
) -> None:
    for name, value in variables.items():
        env.setenv(name, value.format(pem=pem))
    with pytest.raises(SettingsError, match=message) as refused:
        load_settings(tmp_path)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("tls", "api_key", "ca", "enabled"),
    [
        (None, False, False, False),  # the local dev server: plaintext
        (None, True, False, True),  # an API key: TLS, as Temporal Cloud requires
        (None, False, True, True),  # a private CA implies TLS
        (True, False, False, True),  # TLS with the system's roots
        (False, True, False, False),  # explicitly off (TLS terminated by a local sidecar)
    ],
)
def test_tls_is_on_when_asked_or_implied(
    env: pytest.MonkeyPatch,
    tmp_path: Path,
    pem: Path,
    tls: bool | None,
    api_key: bool,
    ca: bool,
    enabled: bool,
) -> None:
    if tls is not None:
        env.setenv("FORGELINE_TEMPORAL_TLS", "yes" if tls else "off")
    if api_key:
        env.setenv("FORGELINE_TEMPORAL_API_KEY", API_KEY)
    if ca:
        env.setenv("FORGELINE_TEMPORAL_TLS_CA", str(pem))
    assert load_settings(tmp_path).temporal_tls_enabled is enabled


def test_tls_settings_survive_stack_json(
    env: pytest.MonkeyPatch, tmp_path: Path, pem: Path
) -> None:
    Settings(
        home=tmp_path, temporal_tls=True, temporal_tls_ca=str(pem), temporal_tls_server_name="t.x"
    ).save()
    settings = load_settings(tmp_path)
    assert (settings.temporal_tls, settings.temporal_tls_ca) == (True, str(pem))
    assert settings.temporal_tls_server_name == "t.x"
    env.setenv("FORGELINE_TEMPORAL_TLS_SERVER_NAME", "override.x")  # the environment wins
    assert load_settings(tmp_path).temporal_tls_server_name == "override.x"


@pytest.mark.parametrize(
    ("variable", "value", "hint"),
    [
        ("FORGELINE_MLFLOW_URI", "https://me:hunter22@mlflow.example", "MLFLOW_TRACKING_PASSWORD"),
        ("FORGELINE_MLFLOW_URI", "https://tok3n-abcdefgh@mlflow.example", "MLFLOW_TRACKING_TOKEN"),
        ("FORGELINE_STORE", "s3://AKIA:s3cr3t-key@bucket/prefix", "AWS_SECRET_ACCESS_KEY"),
        ("FORGELINE_TEMPORAL_ADDRESS", "me:pass-word@temporal.example:7233", "API_KEY"),
        # In the query: a twin's endpoint (passed the check before, and went into stack.json).
        (
            "FORGELINE_TWIN_STORE",
            "s3://twin/p?endpoint=https://me:hunter22@s3.example",
            "AWS profile",
        ),
        (
            "FORGELINE_STORE",
            "s3://b/p?region=x&endpoint=https%3A%2F%2FAKIA%3As3cr3t-key%40s3.x",
            "AWS_SECRET_ACCESS_KEY",
        ),
    ],
)
def test_credentials_in_a_url_are_refused_without_being_repeated(
    env: pytest.MonkeyPatch, tmp_path: Path, variable: str, value: str, hint: str
) -> None:
    env.setenv(variable, value)
    with pytest.raises(SettingsError, match=f"{variable}.*carries credentials.*{hint}") as refused:
        load_settings(tmp_path)
    for secret in ("hunter22", "tok3n-abcdefgh", "s3cr3t-key", "pass-word"):
        assert secret not in str(refused.value)


def test_plain_paths_and_urls_are_not_mistaken_for_credentials(
    env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env.setenv("FORGELINE_STORE", str(tmp_path / "me@corp" / "store"))
    env.setenv("FORGELINE_MLFLOW_URI", "sqlite:///data/me@corp/mlflow.db")
    settings = load_settings(tmp_path)
    assert settings.store == str(tmp_path / "me@corp" / "store")


def test_redact_url_masks_the_secret_part_only() -> None:
    nested = redact_url("s3://twin/p?endpoint=https://me:pw-123@s3.example&region=x")
    assert nested == "s3://twin/p?endpoint=https%3A%2F%2Fme%3A%2A%2A%2A%40s3.example&region=x"
    assert redact_url("https://me:pw@host:5000/x?y=1") == "https://me:***@host:5000/x?y=1"
    assert redact_url("https://TOKEN@host") == "https://***@host"
    assert redact_url("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert redact_url("/a/plain@path") == "/a/plain@path"


def test_redact_text_masks_every_known_secret(env: pytest.MonkeyPatch) -> None:
    env.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    env.setenv("AWS_SESSION_TOKEN", "FwoGZXIvYXdzEXAMPLE-session")
    env.setenv("MLFLOW_TRACKING_PASSWORD", "short")  # too short to mask without mangling text
    text = (
        "SignatureDoesNotMatch for wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY "
        "(token FwoGZXIvYXdzEXAMPLE-session): a short answer"
    )
    assert redact_text(text) == "SignatureDoesNotMatch for *** (token ***): a short answer"
    assert redact_text("nothing secret here") == "nothing secret here"
