"""`forgeline serve` and `forgeline generate` against a real registry (MLflow on SQLite) and a real
`mlflow models serve`: one tiny model, one server, started through the CLI as a user would."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from tokenizers import Tokenizer
from typer.testing import CliRunner

from infra.processes import free_port, port_is_open
from registry.model_files import files_in
from registry.names import ARTIFACTS_TAG, EXPERIMENT, MODEL_FILES_TAG, PRODUCTION
from registry.tracking import record_decision, register
from tests.registry import test_tracking
from worker.cli import app
from worker.cli_common import CliError
from worker.serve import ModelRef, ServeError, check_registered, generate_local, parse_ref
from worker.verified_model import fetch_verified

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-lm"  # the name `registration()` registers under
PROMPT = "To be"
NEW_TOKENS = 12
SEED = 7

artifacts = test_tracking.artifacts  # the exported tiny model: a fixture, found here by name


@dataclass(frozen=True)
class Registry:
    tracking_uri: str
    home: Path
    version: str

    def env(self) -> dict[str, str]:
        return {"FORGELINE_MLFLOW_URI": self.tracking_uri, "FORGELINE_HOME": str(self.home)}


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory, artifacts: dict[str, str]) -> Registry:
    """The tiny model registered and approved (alias production), everything under tmp."""
    root = tmp_path_factory.mktemp("serve")
    tracking_uri = f"sqlite:///{root / 'mlflow.db'}"
    # Created first so the run's artifacts land under tmp, not in ./mlruns of the working folder.
    MlflowClient(tracking_uri).create_experiment(EXPERIMENT, str(root / "artifacts"))
    registered = register(tracking_uri, test_tracking.registration(artifacts, "serve-run"))
    # As the approval gate does it: the decision on the version, then the alias.
    record_decision(tracking_uri, MODEL, registered.version, approver="bob", approve=True,
                    reason="", decided_at=datetime.now(UTC))  # fmt: skip
    return Registry(tracking_uri, root / "home", registered.version)


def _read_lines(stream, lines: queue.Queue[str]) -> None:
    for line in stream:
        lines.put(line)
    lines.put("")  # end of output


def _wait_for(proc: subprocess.Popen, lines: queue.Queue[str], marker: str, timeout: float) -> str:
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=deadline - time.monotonic())
        except queue.Empty:
            break
        seen.append(line)
        if marker in line:
            return line
        if line == "":
            break
    raise AssertionError(f"no {marker!r} (exit {proc.poll()}):\n{''.join(seen)}")


def test_served_model_answers_http_and_generate_matches_it(
    registry: Registry, artifacts: dict[str, str]
) -> None:
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "serve", MODEL],  # NAME alone: alias production
        cwd=REPO,
        env={**os.environ, **registry.env()},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
    try:
        ready = _wait_for(proc, lines, "is ready at", timeout=120)
        print(f"server ready after {time.monotonic() - started:.1f} s")
        assert f"(version {registry.version})" in ready
        url = ready.split("is ready at")[1].strip()
        assert "curl -s " + url + "/invocations" in _wait_for(proc, lines, "curl", 5)

        body = {"inputs": [PROMPT], "params": {"max_new_tokens": NEW_TOKENS, "seed": SEED}}
        request = urllib.request.Request(
            f"{url}/invocations",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            (served,) = json.loads(response.read())["predictions"]
        tokenizer = Tokenizer.from_file(artifacts["tokenizer"])
        assert served.startswith(PROMPT)
        assert len(tokenizer.encode(served).ids) == len(PROMPT) + NEW_TOKENS

        # The same request through `generate`: on the server, and with the model loaded here.
        runner = CliRunner()
        args = [PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--seed", str(SEED)]
        remote = runner.invoke(app, ["generate", MODEL, *args, "--url", url], env=registry.env())
        assert remote.exit_code == 0, remote.output
        assert remote.output == served + "\n"
        local = runner.invoke(app, ["generate", f"{MODEL}@{PRODUCTION}", *args], env=registry.env())
        assert local.exit_code == 0, local.output
        assert local.output == served + "\n"

        port = int(url.rsplit(":", 1)[1])
        proc.send_signal(signal.SIGTERM)  # as `kill` or `docker stop` would
        assert proc.wait(timeout=30) == 0
        _wait_for(proc, lines, "stopping the model server", 5)
        assert not port_is_open("127.0.0.1", port)  # the server's whole group stopped
        assert not list((registry.home / "run").glob("serve-*.pid"))
    finally:
        if proc.poll() is None:  # failed midway: it still stops its server's group on SIGTERM
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_a_missing_alias_or_model_is_a_clear_error(registry: Registry, tmp_path: Path) -> None:
    with pytest.raises(ServeError, match=f"{MODEL} has no version with alias staging"):
        check_registered(registry.tracking_uri, parse_ref(f"{MODEL}@staging"))
    with pytest.raises(ServeError, match="no model named nope in the registry"):
        check_registered(registry.tracking_uri, parse_ref("nope"))
    with pytest.raises(ServeError, match="has no version with number 99"):
        check_registered(registry.tracking_uri, parse_ref(f"{MODEL}/99"))
    assert check_registered(registry.tracking_uri, parse_ref(MODEL)) == str(registry.version)

    # Through the CLI, before anything is started: no production version yet.
    client = MlflowClient(tracking_uri=registry.tracking_uri, registry_uri=registry.tracking_uri)
    client.delete_registered_model_alias(MODEL, PRODUCTION)
    try:
        env = {**registry.env(), "FORGELINE_HOME": str(tmp_path)}
        result = CliRunner().invoke(app, ["serve", MODEL], env=env)
    finally:
        client.set_registered_model_alias(MODEL, PRODUCTION, registry.version)
    assert isinstance(result.exception, CliError)
    assert str(result.exception) == (
        f"{MODEL} has no version with alias production: approve one with "
        f"`forgeline approve RUN` (as an approver) (or serve {MODEL}@candidate)"
    )
    assert not (tmp_path / "logs").exists()  # refused before a server was started


def test_a_production_alias_moved_behind_forgeline_s_back_is_not_served(
    registry: Registry, artifacts: dict[str, str]
) -> None:
    """Anyone who can write to MLflow can point @production anywhere: a version no approval
    was recorded on is refused as production (by number it is still what it is)."""
    sneaked = register(registry.tracking_uri, test_tracking.registration(artifacts, "sneaked"))
    client = MlflowClient(tracking_uri=registry.tracking_uri, registry_uri=registry.tracking_uri)
    client.set_registered_model_alias(MODEL, PRODUCTION, sneaked.version)
    try:
        with pytest.raises(ServeError, match=f"version {sneaked.version}, which Forgeline never"):
            check_registered(registry.tracking_uri, parse_ref(MODEL))
        refused = CliRunner().invoke(app, ["generate", MODEL, PROMPT], env=registry.env())
        assert isinstance(refused.exception, CliError), refused.output
        assert "the alias was moved outside Forgeline" in str(refused.exception)
        by_number = parse_ref(f"{MODEL}/{sneaked.version}")
        assert check_registered(registry.tracking_uri, by_number) == str(sneaked.version)
    finally:
        client.set_registered_model_alias(MODEL, PRODUCTION, registry.version)


def _stored_folder(client: MlflowClient, version: str) -> Path:
    """The version's model folder in the local artifact store (what MLflow serves from)."""
    uri = client.get_model_version_download_uri(MODEL, version)
    if uri.startswith("models:/"):  # a logged model (MLflow 3): its own artifact location
        uri = client.get_logged_model(client.get_model_version(MODEL, version).model_id)
        uri = uri.artifact_location
    return Path(urllib.parse.urlparse(uri).path)


def test_a_version_whose_files_changed_after_registration_is_not_loaded(
    registry: Registry, artifacts: dict[str, str], tmp_path: Path
) -> None:
    """The weights in the artifact store are swapped after registration: the digests recorded
    then no longer match, and neither `generate` nor `serve` loads them."""
    changed = register(registry.tracking_uri, test_tracking.registration(artifacts, "changed"))
    client = MlflowClient(tracking_uri=registry.tracking_uri, registry_uri=registry.tracking_uri)
    recorded = json.loads(client.get_model_version(MODEL, changed.version).tags[ARTIFACTS_TAG])
    assert set(recorded) == {f"artifacts/{Path(p).name}" for p in artifacts.values()}
    (weights,) = [k for k in recorded if k.endswith(".safetensors")]
    stored = _stored_folder(client, changed.version) / weights
    stored.write_bytes(stored.read_bytes()[:-1] + b"\x00")  # one byte of one weight
    ref = parse_ref(f"{MODEL}/{changed.version}")
    with pytest.raises(ServeError, match=rf"{weights} is not the file it was registered with"):
        generate_local(registry.tracking_uri, ref, PROMPT, NEW_TOKENS, SEED)
    served = CliRunner().invoke(
        app, ["serve", str(ref)], env={**registry.env(), "FORGELINE_HOME": str(tmp_path)}
    )
    assert "is not the file it was registered with" in str(served.exception), served.output
    assert not list((tmp_path / "run").glob("*.pid"))  # refused before a server started
    # A version from before the record of every file has only the three digests: a record of
    # them that was removed, or edited into nonsense, is refused too.
    client.delete_model_version_tag(MODEL, changed.version, MODEL_FILES_TAG)
    for tag in ("", "[1, 2]", '{"../../etc/passwd": "0"}'):
        client.set_model_version_tag(MODEL, changed.version, ARTIFACTS_TAG, tag)
        with pytest.raises(ServeError, match="carries no valid record of its files' digests"):
            generate_local(registry.tracking_uri, ref, PROMPT, NEW_TOKENS, SEED)


def test_a_version_whose_serving_code_changed_after_registration_is_not_loaded(
    registry: Registry, artifacts: dict[str, str], tmp_path: Path
) -> None:
    """Registration records every file of the model folder, not only the weights: the serving
    code swapped in the artifact store, a module planted beside it, or the requirements
    removed, and `generate` and `serve` refuse it, naming the file."""
    swapped = register(registry.tracking_uri, test_tracking.registration(artifacts, "swapped"))
    client = MlflowClient(tracking_uri=registry.tracking_uri, registry_uri=registry.tracking_uri)
    folder = _stored_folder(client, swapped.version)
    ref = parse_ref(f"{MODEL}/{swapped.version}")
    verified = fetch_verified(registry.tracking_uri, MODEL, swapped.version, tmp_path / "ok")
    assert verified.summary == f"all {verified.files} files verified"
    assert {"MLmodel", "requirements.txt", "serving_entry.py"} <= set(files_in(verified.path))

    entry = folder / "serving_entry.py"
    original = entry.read_bytes()
    entry.write_bytes(original + b"\nimport os  # anything at all, run as whoever loads it\n")
    with pytest.raises(ServeError, match=r"serving_entry.py is not the file it was registered"):
        generate_local(registry.tracking_uri, ref, PROMPT, NEW_TOKENS, SEED)
    served = CliRunner().invoke(
        app, ["serve", str(ref)], env={**registry.env(), "FORGELINE_HOME": str(tmp_path)}
    )
    assert "serving_entry.py is not the file it was registered" in str(served.exception)
    assert not list((tmp_path / "run").glob("*.pid"))  # refused before a server started
    entry.write_bytes(original)

    planted = folder / "code" / "tqdm.py"
    planted.write_text("print('planted')\n")
    with pytest.raises(ServeError, match=r"code/tqdm.py is in its model folder but not in the"):
        generate_local(registry.tracking_uri, ref, PROMPT, NEW_TOKENS, SEED)
    planted.unlink()

    (folder / "requirements.txt").unlink()
    with pytest.raises(ServeError, match=r"requirements.txt is missing, though its registration"):
        generate_local(registry.tracking_uri, ref, PROMPT, NEW_TOKENS, SEED)
    # The record itself is held to its tagged digest: an edited one is refused.
    client.set_model_version_tag(MODEL, swapped.version, MODEL_FILES_TAG, "0" * 64)
    with pytest.raises(ServeError, match=r"is not the record its registration made"):
        generate_local(registry.tracking_uri, ref, PROMPT, NEW_TOKENS, SEED)


def test_a_version_from_before_the_record_says_which_files_went_unchecked(
    registry: Registry, artifacts: dict[str, str], tmp_path: Path
) -> None:
    older = register(registry.tracking_uri, test_tracking.registration(artifacts, "older"))
    client = MlflowClient(tracking_uri=registry.tracking_uri, registry_uri=registry.tracking_uri)
    client.delete_model_version_tag(MODEL, older.version, MODEL_FILES_TAG)  # as registered before
    verified = fetch_verified(registry.tracking_uri, MODEL, older.version, tmp_path)
    assert {"MLmodel", "requirements.txt", "serving_entry.py"} <= set(verified.unchecked)
    assert not any(path.startswith("artifacts/") for path in verified.unchecked)
    assert verified.summary.startswith(
        "files verified only in part: its weights, config and tokenizer; registered before "
        "Forgeline recorded every file, so these were not checked: MLmodel, code/"
    )


def test_model_references() -> None:
    assert parse_ref("tiny") == ModelRef("tiny", alias=PRODUCTION)
    assert parse_ref("tiny@candidate") == ModelRef("tiny", alias="candidate")
    assert parse_ref("tiny/03") == ModelRef("tiny", version="3")
    assert parse_ref("tiny/3").uri == "models:/tiny/3"
    assert parse_ref("tiny").uri == "models:/tiny@production"
    with pytest.raises(CliError, match="model name 'Tiny LM' is not valid"):
        parse_ref("Tiny LM")
    with pytest.raises(ServeError, match="version 'latest' is not a number"):
        parse_ref("tiny/latest")
    with pytest.raises(ServeError, match="alias 'a b' is not valid"):
        parse_ref("tiny@a b")


def test_generate_against_no_server_is_one_clear_line() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(app, ["generate", "tiny", "hi", "--url", url])
    assert isinstance(result.exception, CliError)
    assert str(result.exception).startswith(f"cannot reach the model server at {url} (")
    assert "`forgeline serve MODEL`" in str(result.exception)


# A version's serving entry that probes what it can reach from where it is loaded: the caller's
# environment, the caller's token file and home, and other processes' environments (the
# caller's); it still generates, and adds what it found as one JSON line.
HOSTILE_ENTRY = """
import json, os
from pathlib import Path
from mlflow.models import set_model
from trainer.serving import GPTTextModel

SECRETS = ("FORGELINE_TOKEN", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD")


class Probe(GPTTextModel):
    def predict(self, context, model_input, params=None):
        found = {{name: os.environ.get(name) for name in SECRETS}}
        try:
            found["token file"] = Path({token_file!r}).read_text()
        except OSError as err:
            found["token file"] = type(err).__name__
        try:
            Path({marker!r}).write_text("approved by the model")
            found["marker"] = "written"
        except OSError as err:
            found["marker"] = type(err).__name__
        found["other processes"] = [
            entry.decode(errors="replace")
            for environ in Path("/proc").glob("[0-9]*/environ")
            for entry in _read(environ).split(b"\\0")
            if entry.startswith(tuple(f"{{name}}=".encode() for name in SECRETS))
        ]
        texts = super().predict(context, model_input, params)
        return [text + "\\n" + json.dumps(found) for text in texts]


def _read(path):
    try:
        return path.read_bytes()
    except OSError:
        return b""


set_model(Probe())
"""


def test_a_candidate_s_serving_code_gets_none_of_the_caller_s_secrets(
    registry: Registry, artifacts: dict[str, str], tmp_path: Path
) -> None:
    """`generate M@candidate` runs the submitter's serving code in a process of its own, in a
    box: it finds no token in its environment, in the caller's state folder or in any other
    process, cannot write to the caller's home, and still generates text."""
    state, home = tmp_path / "state", tmp_path / "home"
    state.mkdir()
    home.mkdir()
    (state / "token").write_text("fl_file_secret\n")
    entry = tmp_path / "serving_entry.py"
    entry.write_text(HOSTILE_ENTRY.format(token_file=str(state / "token"), marker=str(home / "m")))
    hostile = replace(test_tracking.registration(artifacts, "hostile"), python_model=str(entry))
    candidate = register(registry.tracking_uri, hostile).version  # the candidate now
    secrets = {
        "FORGELINE_TOKEN": "fl_env_secret",
        "AWS_SECRET_ACCESS_KEY": "aws_secret",
        "MLFLOW_TRACKING_PASSWORD": "mlflow_secret",
    }
    env = {**registry.env(), **secrets, "FORGELINE_HOME": str(state), "HOME": str(home)}
    args = ["generate", f"{MODEL}@candidate", PROMPT, "--max-new-tokens", str(NEW_TOKENS)]
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 0, result.output
    text, probe = result.stdout.splitlines()
    assert text.startswith(PROMPT) and len(text) == len(PROMPT) + NEW_TOKENS  # one char a token
    found = json.loads(probe)
    assert found["marker"] != "written" and not (home / "m").exists()
    assert found["token file"] != "fl_file_secret\n"
    assert found["other processes"] == []
    assert [name for name in secrets if found[name] is not None] == []
    assert not any(secret in result.output for secret in [*secrets.values(), "fl_file_secret"])

    # Where no box can be made (no bwrap on PATH), the candidate is refused in one line that
    # says why and what to do, before any of its code runs.
    refused = CliRunner().invoke(app, args, env={**env, "PATH": str(tmp_path)})
    assert isinstance(refused.exception, CliError), refused.output
    assert str(refused.exception) == (
        f"{MODEL} version {candidate} has no approval, and its code cannot be "
        "boxed here: bwrap is not installed (Debian and Ubuntu: apt-get install bubblewrap); "
        "unboxed it would run as you and could read your files and your processes' "
        "environments, your token among them: make bwrap work, or pass --unconfined to run it "
        "anyway"
    )
    assert not (home / "m").exists()
