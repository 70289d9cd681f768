"""The `forgeline` CLI under bad arguments, fuzzed in-process: broken spec, cluster, planning,
simulation and approval files, names with separators, '..' or control characters, ids and
versions that are not, and a stack that is down. Every one ends with a non-zero exit and the
error `forgeline` prints as a line, never a traceback; a refused file changes nothing
installed."""

from __future__ import annotations

import json
import socket
import traceback
from pathlib import Path

import pytest
import typer
from click.testing import Result
from hypothesis import event, example, given
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from typer.testing import CliRunner

from registry.approvals import parse_approvals
from tests.fuzz_strategies import (
    EXAMPLES,
    SPEC_EXAMPLES,
    damaged_bytes,
    escaping_names,
    fuzz,
    mutated_specs,
    mutated_toml,
    toml_document,
    write_spec,
)
from worker import simulate_cli
from worker.cli import app, outcome
from worker.cli_common import ExitCode
from worker.specfile import SpecError, load_spec
from workflows.contracts.names import is_valid_name

RUNNER = CliRunner()
Env = dict[str, str | None]  # for CliRunner: None unsets a variable


def _closed_port() -> int:
    # Bound and released: nothing listens there (a race with another process is harmless:
    # it would answer as something that is not Temporal, which is an error too).
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def env(tmp_path: Path) -> Env:
    """A state folder of its own (its store inside), and a Temporal and MLflow not there."""
    port = _closed_port()
    return {
        "FORGELINE_HOME": str(tmp_path / "home"),
        "FORGELINE_TEMPORAL_ADDRESS": f"127.0.0.1:{port}",
        "FORGELINE_MLFLOW_URI": f"http://127.0.0.1:{port}",
        "FORGELINE_API_URL": f"http://127.0.0.1:{port}",
        "FORGELINE_STORE": None,  # unset: the state folder's store
    }


def invoke(args: list[str], env: Env) -> tuple[Result, str]:
    """Run `forgeline ARGS` here; the error it shows a person, checked to be one: what
    `forgeline`'s main() prints for the exception (outcome) or click's usage error."""
    result = RUNNER.invoke(app, args, env=env)
    assert "Traceback (most recent call last)" not in result.output, result.output[-2000:]
    error = result.exception
    if error is None or isinstance(error, SystemExit):
        shown = result.output
    else:
        expected = outcome(error)
        shown = expected[0] if expected else ""
        if expected:
            result.exit_code = expected[1]  # what main() exits with for it
        trace = "".join(traceback.format_exception(error))
        assert shown, f"forgeline {args!r} would print a traceback:\n{trace}"
    if result.exit_code != 0:
        assert shown.strip(), args
        if currently_in_test_context():
            event(f"exit {result.exit_code}: {type(error).__name__}")
        for line in shown.split("\n"):
            assert len(line) < 2000, line[:300]
    return result, shown


def _loads(path: Path) -> bool:
    try:
        load_spec(path)
    except SpecError:
        return False
    return True


# --- spec files -----------------------------------------------------------------------------


@fuzz(40)
@given(
    mutated_specs(max_mutations=2),
    st.one_of(st.none(), st.sampled_from(["0", "-3", "abc", "1e3", str(10**30), "65536"])),
    st.booleans(),
)
def test_plan_reads_any_spec_file(
    tmp_path: Path, env: Env, mutated: tuple, vocab: str | None, as_json: bool
) -> None:
    path = write_spec(tmp_path, mutated[0])
    args = ["plan", str(path), *(["--vocab", vocab] if vocab else []), *(["--json"] * as_json)]
    result, shown = invoke(args, env)
    if vocab not in (None, "65536", str(10**30)):
        assert result.exit_code == 2 and "Usage:" in shown  # click checks options first
    elif not _loads(path):
        assert result.exit_code != 0 and "invalid run spec" in shown
    else:
        assert result.exit_code == 0, shown  # a valid spec is planned, whatever its sizes


@fuzz(30)
@given(
    mutated_specs(max_mutations=2),
    st.sampled_from([["run", "{spec}", "--detach"], ["data", "prepare", "{spec}"]]),
)
def test_run_and_prepare_refuse_a_bad_spec_before_reaching_anything(
    tmp_path: Path, env: Env, mutated: tuple, command: list[str]
) -> None:
    path = write_spec(tmp_path, mutated[0])
    result, shown = invoke([part.replace("{spec}", str(path)) for part in command], env)
    if _loads(path):  # then the API (run) or Temporal (prepare) is asked, and is not there
        assert result.exit_code == ExitCode.DOWN, shown
        assert shown.startswith(("cannot reach Temporal at 127.0.0.1:", "cannot reach http")), shown
    else:
        assert result.exit_code == ExitCode.BAD_INPUT, shown
        assert shown.startswith(f"{path}: invalid run spec"), shown


@fuzz(20)
@given(st.sampled_from(SPEC_EXAMPLES).flatmap(lambda n: damaged_bytes((EXAMPLES / n).read_bytes())))
def test_damaged_spec_files_are_one_error(tmp_path: Path, env: Env, raw: bytes) -> None:
    path = tmp_path / "spec.toml"
    path.write_bytes(raw)
    result, shown = invoke(["plan", str(path)], env)
    assert result.exit_code == 0 or str(path) in shown


# --- names, ids and versions ----------------------------------------------------------------

NAME_COMMANDS = [
    ["status", "{}"],
    ["cancel", "{}"],
    ["report", "{}"],
    ["approve", "{}"],
    ["reject", "{}", "--reason", "no"],
    ["node", "drain", "{}"],
    ["node", "undrain", "{}"],
    ["chaos", "kill-node", "{}"],
    ["chaos", "fail-health", "{}"],
    ["chaos", "hang-node", "{}"],
    ["lineage", "{}", "1"],
    ["generate", "{}", "ROMEO:", "--url", "http://127.0.0.1:{port}"],
    ["generate", "{}@candidate", "ROMEO:", "--url", "http://127.0.0.1:{port}"],
]


@fuzz(100)
@given(st.sampled_from(NAME_COMMANDS), escaping_names())
@example(["status", "{}"], "run\n")
@example(["status", "{}"], "../etc")
def test_names_are_checked_before_anything_is_reached(
    env: Env, command: list[str], name: str
) -> None:
    port = env["FORGELINE_TEMPORAL_ADDRESS"].rsplit(":", 1)[1]
    args = [part.replace("{}", name).replace("{port}", port) for part in command]
    result, shown = invoke(args, env)
    assert result.exit_code != 0  # nothing here exists, or is up
    if not is_valid_name(name) and not name.startswith("-"):  # '-x' is an option to click
        # Refused as a name (or, for generate, as NAME/VERSION), before anything is asked.
        assert any(w in shown for w in ("is not valid", "not a number", "Usage:", "Error")), shown
        assert "cannot reach" not in shown, shown


@fuzz(30)
@given(st.one_of(escaping_names(), st.from_regex(r"[0-9a-f]{8,64}", fullmatch=True)))
@example("../../x")
def test_data_report_takes_only_snapshot_ids(env: Env, snapshot: str) -> None:
    result, shown = invoke(["data", "report", snapshot], env)
    assert result.exit_code != 0
    assert "is not valid" in shown or "no snapshot" in shown or "Usage:" in shown, shown


@fuzz(20)
@given(
    st.sampled_from(["3", "@production", "0", "-1", "@", "@a/b", "../1", "1\n", "x" * 300, "@a b"])
    | st.text(max_size=20)
)
def test_lineage_versions_are_checked_before_mlflow(env: Env, version: str) -> None:
    result, shown = invoke(["lineage", "tiny", version], env)
    assert result.exit_code != 0
    assert "cannot reach MLflow" in shown or "is neither" in shown or "Usage:" in shown, shown


@fuzz(10)
@given(
    st.sampled_from(
        ["not a url", "ftp://x", "http://", "http://[::1", "file:///etc", "", "x" * 500]
    )
)
def test_generate_refuses_a_url_it_cannot_use(env: Env, url: str) -> None:
    result, shown = invoke(["generate", "tiny", "hi", "--url", url], env)
    assert result.exit_code != 0
    # An empty --url means "load the model here", which needs MLflow.
    assert "model server" in shown or (not url and "cannot reach MLflow" in shown), shown


def test_a_long_approval_note_is_refused_before_temporal(env: Env) -> None:
    result, shown = invoke(["approve", "tiny", "--note", "x" * 10_000], env)
    assert result.exit_code != 0 and "keep it under 5,000" in shown


# --- other files people write -----------------------------------------------------------------


@fuzz(40)
@given(
    st.one_of(
        mutated_toml("approvals.toml").map(lambda data: toml_document(data).encode()),
        damaged_bytes((EXAMPLES / "approvals.toml").read_bytes()),
        st.binary(max_size=200),
    )
)
def test_refused_approval_rules_leave_the_installed_ones(
    tmp_path: Path, env: Env, raw: bytes
) -> None:
    installed = Path(env["FORGELINE_HOME"]) / "approvals.toml"
    good = (EXAMPLES / "approvals.toml").read_bytes()
    installed.parent.mkdir(parents=True, exist_ok=True)
    installed.write_bytes(good)
    path = tmp_path / "rules.toml"
    path.write_bytes(raw)
    result, shown = invoke(["approvals", "apply", str(path)], env)
    # No API here: rules that pass the check are sent to it (and refused as unreachable).
    assert result.exit_code != 0
    assert installed.read_bytes() == good  # nothing installed is lost or overwritten
    if shown.startswith("cannot reach"):
        event("checked, sent")
        parse_approvals(raw.decode(), str(path))  # only rules that pass the check are sent
    else:
        assert str(path) in shown, shown


def _simulated(*_args: object) -> None:
    raise typer.Exit(0)  # accepted: the simulation itself takes minutes, not a fuzz test's ms


@fuzz(30)
@given(
    st.one_of(
        mutated_toml("simulate.toml").map(lambda data: toml_document(data).encode()),
        damaged_bytes((EXAMPLES / "simulate.toml").read_bytes()),
    ),
    st.sampled_from([[], ["--days", "nan"], ["--days", "inf"], ["--days", "-1"], ["--seed", "x"]]),
)
def test_simulate_refuses_bad_settings_by_name(
    tmp_path: Path, env: Env, raw: bytes, options: list[str]
) -> None:
    path = tmp_path / "simulate.toml"
    path.write_bytes(raw)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(simulate_cli, "run", _simulated)
        patch.setattr(simulate_cli, "compare", _simulated)
        result, shown = invoke(["simulate", "--config", str(path), *options], env)
    if result.exit_code == 0:
        event("accepted")
        assert options == []  # nan, inf and -1 days are refused, and "x" is no seed
        # Finite throughout: JSON without NaN or Infinity can hold it.
        json.dumps(simulate_cli.load_config(path).model_dump(mode="json"), allow_nan=False)
    elif not options:
        assert str(path) in shown, shown


@fuzz(30)
@given(
    st.one_of(
        mutated_toml("cluster.toml").map(lambda data: toml_document(data).encode()),
        damaged_bytes((EXAMPLES / "cluster.toml").read_bytes()),
    )
)
def test_cluster_apply_checks_the_file_before_temporal(
    tmp_path: Path, env: Env, raw: bytes
) -> None:
    path = tmp_path / "cluster.toml"
    path.write_bytes(raw)
    result, shown = invoke(["cluster", "apply", str(path)], env)
    assert result.exit_code != 0
    assert str(path) in shown or shown.startswith("cannot reach http"), shown


@fuzz(30)
@given(
    st.one_of(
        mutated_toml("plan-h100.toml").map(lambda data: toml_document(data).encode()),
        damaged_bytes((EXAMPLES / "plan-h100.toml").read_bytes()),
    )
)
def test_plan_checks_its_hardware_file(tmp_path: Path, env: Env, raw: bytes) -> None:
    path = tmp_path / "hardware.toml"
    path.write_bytes(raw)
    spec = EXAMPLES / "tiny.toml"
    result, shown = invoke(["plan", str(spec), "--cluster", str(path)], env)
    assert result.exit_code == 0 or str(path) in shown, shown


# --- chaos ----------------------------------------------------------------------------------


def test_corrupt_grad_is_aimed_at_the_next_step_without_at_step(env: Env) -> None:
    """Without --at-step it reaches the node (it was refused: its default broke --at-step's
    minimum); a finite factor of 1 corrupts nothing and is refused with the fix."""
    _, shown = invoke(["chaos", "corrupt-grad", "n0"], env)
    assert "node n0 runs no training ranks now" in shown, shown
    _, shown = invoke(["chaos", "corrupt-grad", "n0", "--finite", "--scale", "3"], env)
    assert "node n0 runs no training ranks now" in shown, shown
    result, shown = invoke(["chaos", "corrupt-grad", "n0", "--finite", "--scale", "1"], env)
    assert result.exit_code == 3 and "--scale 1.0 changes nothing" in shown, shown
