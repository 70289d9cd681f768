"""The local MLflow's login: kept private, kept across restarts, sent only to its own server.

The server side (401 without the login, 403 for the viewer, Forgeline's writes accepted) is
tested against the e2e stack's MLflow, in tests/e2e/test_cli_end_to_end.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from infra import mlflow_login
from infra.errors import StackError

URI = "http://127.0.0.1:5123"


def test_the_login_is_private_and_survives_a_restart_on_another_port(tmp_path: Path) -> None:
    first = mlflow_login.prepare(tmp_path, URI)
    path = tmp_path / mlflow_login.LOGIN_FILE
    assert path.stat().st_mode & 0o777 == 0o600
    assert first.writer_password not in repr(first)  # never in a log line or a traceback
    (tmp_path / mlflow_login.AUTH_DB).write_text("users")  # the server made its users
    again = mlflow_login.prepare(tmp_path, "http://127.0.0.1:6000")
    assert again.writer_password == first.writer_password and again.uri.endswith(":6000")
    assert (tmp_path / mlflow_login.AUTH_DB).exists()  # its users keep their passwords
    config = (tmp_path / mlflow_login.AUTH_CONFIG).read_text()
    assert "default_permission = READ" in config and "admin_username = forgeline" in config


def test_a_lost_login_drops_the_users_it_cannot_sign_in_as(tmp_path: Path) -> None:
    old = mlflow_login.prepare(tmp_path, URI)
    (tmp_path / mlflow_login.AUTH_DB).write_text("users")
    (tmp_path / mlflow_login.LOGIN_FILE).unlink()
    new = mlflow_login.prepare(tmp_path, URI)
    assert new.writer_password != old.writer_password
    assert not (tmp_path / mlflow_login.AUTH_DB).exists()  # made again, with the new admin


def test_a_login_of_another_format_is_refused_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / mlflow_login.LOGIN_FILE).write_text('{"version": 2}')
    with pytest.raises(StackError, match=r"delete it and mlflow-auth\.db"):
        mlflow_login.read(tmp_path)


def test_the_login_goes_only_to_its_own_server_and_never_over_the_callers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    login = mlflow_login.prepare(tmp_path, URI)
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    mlflow_login.use_local_login(tmp_path, "https://mlflow.example.org")
    assert "MLFLOW_TRACKING_PASSWORD" not in os.environ
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "an operator's")
    mlflow_login.use_local_login(tmp_path, URI + "/")
    assert "MLFLOW_TRACKING_PASSWORD" not in os.environ
    monkeypatch.delenv("MLFLOW_TRACKING_TOKEN")
    mlflow_login.use_local_login(tmp_path, URI + "/")
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "forgeline"
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == login.writer_password
