"""`forgeline logs` and GET /v1/runs/NAME/logs: the ranks' output that agents shipped to the
store, read back through the API under a person's token (who holds no store key), by run, node,
rank and attempt, and followed as new pieces are shipped; only by the run's team, its owner and
admins."""

from __future__ import annotations

import asyncio
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from forgeline import ApiError, Client
from infra.processes import free_port
from infra.settings import Settings
from infra.store.local import LocalStore
from infra.tokens import TokenStore
from tests.api_server import serving_api
from tests.asgi_call import Answer, call
from tests.e2e.conftest import FORGELINE
from trainer.rank_logs import LogShipper
from worker.api import make_app
from worker.cli_common import ExitCode, get_client
from worker.runs import submit
from workflows.contracts.spec import RunSpec


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """The API over the state folder's own store (no Temporal), and an admin's token: an admin
    reads every run's logs without asking whose the run is (the team's reading: below)."""
    settings = Settings(home=tmp_path, temporal_address=f"127.0.0.1:{free_port()}")
    token, _ = TokenStore(tmp_path).create("rhea", ["admin"], created_by="test")
    with serving_api(settings) as url:
        yield url, token


def forgeline(api: tuple[str, str], *args: str) -> subprocess.Popen | subprocess.CompletedProcess:
    url, token = api
    # Nothing of the stack's: no store, no home with its files; only the API and a token.
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("FORGELINE_", "AWS_"))}
    env = {**clean, "FORGELINE_API_URL": url, "FORGELINE_TOKEN": token,
           "FORGELINE_HOME": "/nonexistent/forgeline"}  # fmt: skip
    if args[-1] == "--follow":
        return subprocess.Popen([FORGELINE, *args], env=env, stdout=subprocess.PIPE, text=True)
    return subprocess.run([FORGELINE, *args], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def ship(
    store: LocalStore, root: Path, generation: int, node: str, rank: int, run: str = "tiny"
) -> None:
    folder = root / "logs" / run / f"{generation}-{node}"
    folder.mkdir(parents=True)
    (folder / f"rank-{rank}.log").write_text(f"[rank {rank}/2 gen {generation}] on {node}\n")
    (folder / "torchrun.log").write_text(f"torchrun of {node}\n")
    LogShipper(store, run, generation, node, folder).ship(final=True)


def test_logs_are_read_back_by_run_node_rank_and_attempt(
    api: tuple[str, str], tmp_path: Path
) -> None:
    store = LocalStore(tmp_path / "store")  # the API's store: the state folder's own
    for generation, node, rank in ((1, "h1", 0), (1, "h2", 1), (2, "h1", 0), (2, "h3", 1)):
        ship(store, tmp_path, generation, node, rank)

    latest = forgeline(api, "logs", "tiny")
    assert latest.returncode == 0, latest.stdout + latest.stderr
    assert "[rank 0/2 gen 2] on h1" in latest.stdout and "[rank 1/2 gen 2] on h3" in latest.stdout
    assert "gen 1]" not in latest.stdout and "torchrun of h3" in latest.stdout
    assert "==> attempt (generation) 2, h3, rank-1 <==" in latest.stdout
    one = forgeline(api, "logs", "tiny", "--rank", "1", "--attempt", "1").stdout
    assert "[rank 1/2 gen 1] on h2" in one and "rank 0" not in one and "torchrun" not in one
    node = forgeline(api, "logs", "tiny", "--node", "h1", "--attempt", "1").stdout
    assert "on h1" in node and "h2" not in node
    missing = forgeline(api, "logs", "tiny", "--attempt", "7")
    assert missing.returncode == ExitCode.NOT_FOUND, missing.stdout
    assert "has no logs of attempt 7: it has [1, 2]" in missing.stdout
    other = forgeline(api, "logs", "other")
    assert other.returncode == ExitCode.NOT_FOUND and "no logs of run other" in other.stdout

    # The API itself: what a follower already read is not sent again; a bad cursor is a 422.
    client = Client(*api)
    first = client.logs("tiny", node="h1")
    assert [p.file for p in first.pieces] == ["rank-0", "torchrun"] and first.attempt == 2
    cursors = [f"{p.node_id}/{p.file}:{p.offset}" for p in first.pieces]
    assert client.logs("tiny", node="h1", after=cursors).pieces == []
    with pytest.raises(ApiError) as bad:
        client.logs("tiny", after=["h1-rank-0"])
    assert (bad.value.status, bad.value.field) == (422, "after")


def test_logs_follow_prints_lines_as_they_are_shipped(api: tuple[str, str], tmp_path: Path) -> None:
    store, folder = LocalStore(tmp_path / "store"), tmp_path / "gen-1"
    folder.mkdir()
    log = folder / "rank-0.log"
    log.write_text("first line\n")
    shipper = LogShipper(store, "tiny", 1, "h1", folder)
    shipper.ship()
    follower = forgeline(api, "logs", "tiny", "--follow")
    assert isinstance(follower, subprocess.Popen)
    try:
        assert follower.stdout is not None
        assert "==> attempt (generation) 1, h1, rank-0 <==" in follower.stdout.readline()
        assert follower.stdout.readline() == "first line\n"
        with open(log, "a") as handle:
            handle.write("second line\n")
        shipper.ship()
        assert follower.stdout.readline() == "second line\n"  # within a poll, not at the end
    finally:
        follower.kill()
        follower.wait()


def test_a_run_s_logs_are_read_by_its_team_its_owner_and_admins_only(
    tmp_path: Path, temporal_address: str
) -> None:
    settings = Settings(home=tmp_path, temporal_address=temporal_address)
    run, ghost = f"vis-{uuid.uuid4().hex[:8]}", f"gone-{uuid.uuid4().hex[:8]}"
    spec = RunSpec.model_validate({
        "name": run, "owner": "olga", "data": {"sources": ["/corpus.txt"]},
        "resources": {"team": "vision"},
    })  # fmt: skip
    store = LocalStore(tmp_path / "store")
    ship(store, tmp_path, 1, "h1", 0, run)
    ship(store, tmp_path, 1, "h1", 0, ghost)  # logs of a run Temporal does not know
    # Person -> roles: the team's submitter and approver, a submitter of every team, an admin,
    # and the owner, who may whatever roles their token has now; not another team, nor operate.
    may = {"mia": ["submit:vision"], "abe": ["approve:vision"], "sol": ["submit:*"],
           "root": ["admin"], "olga": ["read"]}  # fmt: skip
    may_not = {"nils": ["submit:nlp", "approve:nlp"], "opal": ["operate"]}
    tokens = TokenStore(tmp_path)
    made = {who: tokens.create(who, roles, "test")[0] for who, roles in {**may, **may_not}.items()}
    app = make_app(settings)

    async def logs(who: str, of: str) -> Answer:
        bearer = {"Authorization": f"Bearer {made[who]}"}
        return await call(app, "GET", f"/v1/runs/{of}/logs", bearer)

    async def check() -> None:
        client = await get_client(settings)
        await submit(client, spec, "0" * 64)  # as the API submits it; no worker takes it up here
        try:
            for who in may:
                answer = await logs(who, run)
                assert answer.status == 200, (who, answer.body)
                assert [p["text"] for p in answer.json()["pieces"]] == [
                    "[rank 0/2 gen 1] on h1\n", "torchrun of h1\n"
                ], who  # fmt: skip
            for who in may_not:
                refused = await logs(who, run)
                assert refused.status == 403, who
                message = refused.json()["error"]["message"]
                assert f"run {run}'s logs are team 'vision''s" in message
                assert "submit:vision or approve:vision" in message
            unknown = await logs("mia", ghost)
            assert unknown.status == 403 and "only the role admin" in unknown.body.decode()
            assert (await logs("root", ghost)).json()["pieces"]
        finally:
            await client.get_workflow_handle(run).terminate("test over")

    asyncio.run(check())
