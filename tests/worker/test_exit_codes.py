"""`forgeline`'s exit codes, one per kind of outcome (README, Exit codes), each from a real
process through main(): what a script that calls the CLI branches on. A run that ends FAILED
exits 1 in tests/e2e/test_user_code.py, on the real stack."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from infra.processes import free_port
from infra.settings import Settings
from infra.tokens import TokenStore
from tests.api_server import serving_api
from tests.conftest import REPO
from tests.fresh_env import without_pythonpath
from worker.cli_common import ExitCode

# A command that hits a bug: what main() does with an exception it does not expect.
_BUG = (
    "import sys, worker.cli as cli\n"
    "@cli.app.command('boom')\n"
    "def boom() -> None:\n"
    "    {}['missing']\n"
    "sys.argv = ['forgeline', 'boom']\n"
    "cli.main()\n"
)


def forgeline(
    home: Path, *args: str, token: str | None = None, api_url: str | None = None
) -> subprocess.CompletedProcess:
    api_url = api_url or f"http://127.0.0.1:{free_port()}"  # by default, nobody answers there
    env = {**without_pythonpath(), "FORGELINE_HOME": str(home), "COLUMNS": "200",
           "FORGELINE_API_URL": api_url}  # fmt: skip
    env.pop("FORGELINE_TOKEN", None)
    if token:
        env["FORGELINE_TOKEN"] = token
    argv = ["-c", _BUG] if args == ("boom",) else ["-m", "worker.cli", *args]
    return subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (("--version",), ExitCode.OK, "forgeline "),
        (("status",), ExitCode.USAGE, "Usage: "),
        (("status", "Not A Name"), ExitCode.BAD_INPUT, "is not valid"),
        (("runs",), ExitCode.DOWN, "cannot reach http://127.0.0.1:"),
        (("boom",), ExitCode.BUG, "KeyError: 'missing'"),
    ],
    ids=lambda v: v.name.lower() if isinstance(v, ExitCode) else None,
)
def test_each_kind_of_outcome_has_its_code(
    tmp_path: Path, args: tuple[str, ...], code: ExitCode, says: str
) -> None:
    done = forgeline(tmp_path, *args)
    assert done.returncode == code, done.stdout + done.stderr[-2000:]
    assert says in done.stdout + done.stderr
    # A bug keeps its traceback; everything else is one line without one.
    assert ("Traceback" in done.stderr) == (code == ExitCode.BUG), done.stderr[-2000:]


def test_a_refusal_exits_refused(tmp_path: Path) -> None:
    tokens = TokenStore(tmp_path)
    tokens.create("ops", ["admin"], created_by="test")
    reader, _ = tokens.create("rhea", ["read"], created_by="test")
    done = forgeline(tmp_path, "tokens", "list", token=reader)
    assert done.returncode == ExitCode.REFUSED, done.stdout + done.stderr[-2000:]
    assert "rhea's token is not an admin's" in done.stdout


def test_what_is_not_there_exits_not_found(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, temporal_address=f"127.0.0.1:{free_port()}")
    reader, _ = TokenStore(tmp_path).create("rhea", ["read"], created_by="test")
    with serving_api(settings) as url:
        done = forgeline(tmp_path, "logs", "never-ran", token=reader, api_url=url)
    assert done.returncode == ExitCode.NOT_FOUND, done.stdout + done.stderr[-2000:]
    assert "no logs of run never-ran" in done.stdout and "Traceback" not in done.stderr
