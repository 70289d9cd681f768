"""The HTTP API on the real stack (`forgeline up` starts it), driven by `forgeline.Client` as a
notebook would: identities from tokens, a run submitted, resubmitted, decided on and cancelled
through /v1, and every refusal in the one error shape."""

from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from forgeline import ApiError, Client
from infra.tokens import LOCAL_TOKEN_FILE, TokenStore
from tests.conftest import REPO
from tests.e2e.conftest import FORGELINE, Stack, variant, wait_for
from tests.prometheus_text import Samples, samples, value
from worker.cli_common import ExitCode
from worker.process_metrics import endpoints
from worker.temporal_client import connect
from workflows.contracts.api_models import RunList, RunView
from workflows.contracts.cluster_models import Allocation, ClusterState, NodeInfo
from workflows.contracts.names import GANG_GRANTED_SIGNAL

SCHEMA = REPO / "docs" / "openapi.json"


FORGED_GENERATION = 999


async def forge_a_grant(stack: Stack, run: str) -> None:
    client = await connect(stack.settings)
    node = NodeInfo(node_id="node-2", rdzv_port=1, incarnation="forged")
    forged = Allocation(run_id=run, generation=FORGED_GENERATION, nodes=[node, node])
    await client.get_workflow_handle(run).signal(GANG_GRANTED_SIGNAL, forged)


def scrape(url: str, token: str) -> Samples:
    request = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.headers["Content-Type"].startswith("text/plain; version=")
        return samples(answer.read().decode())


def scrape_process(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return samples(answer.read().decode())


def refused(call, status: int, code: str) -> ApiError:
    with pytest.raises(ApiError) as raised:
        call()
    assert (raised.value.status, raised.value.code) == (status, code), raised.value
    return raised.value


def test_a_run_through_the_api_and_who_may_do_what(stack: Stack, tmp_path: Path) -> None:
    # alice may submit to research and approve its models: but never her own run.
    made = stack.cli("tokens", "create", "alice", "--role", "submit:research",
                     "--role", "approve:research", "--note", "e2e")  # fmt: skip
    url = stack.settings.api_url
    alice = Client(url, made.stdout.strip().splitlines()[-1])  # printed once, last
    tokens = TokenStore(stack.home)
    bob_token, carol_token, dave_token = (
        tokens.create(person, [role], created_by="e2e")[0]
        for person, role in (("bob", "approve:vision"), ("carol", "approve:research"),
                             ("dave", "read"))
    )  # fmt: skip
    bob, carol, dave = (Client(url, t) for t in (bob_token, carol_token, dave_token))

    assert alice.whoami().person == "alice"
    refused(Client(url, "flt_nope").runs, 401, "unauthenticated")
    request = urllib.request.Request(f"{url}/v1/runs")  # no token at all: the same shape
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(request, timeout=30)
    assert raw.value.code == 401 and json.loads(raw.value.read())["error"]["fix"]

    spec = variant(tmp_path, "via-api", team="research", steps=40)
    error = refused(lambda: dave.submit(spec), 403, "forbidden")
    assert error.field == "resources.team" and "submit:research" in (error.fix or "")
    as_carol = {"name": "x", "owner": "carol", "data": {"sources": ["/dev/null"]}}
    assert refused(lambda: alice.submit(as_carol), 422, "invalid_spec").field == "owner"
    bad = tmp_path / "bad.toml"
    bad.write_text(spec.read_text().replace("steps = 40", 'steps = "many"'))
    assert refused(lambda: alice.submit(bad), 422, "invalid_spec").field == "train.steps"
    racked = tmp_path / "racked.toml"  # the local stack's cluster file declares no levels
    racked.write_text(spec.read_text().replace("[resources]\n", '[resources]\ntopology = "rack"\n'))
    error = refused(lambda: alice.submit(racked), 422, "invalid_spec")
    assert error.field == "resources.topology" and "its levels are pod" in error.message
    assert "via-api" not in [r.status.name for r in dave.runs()]  # nothing reached Temporal

    run = alice.submit(spec, idempotency_key="notebook-cell-7")
    assert run.status.owner == "alice" and run.status.team == "research"
    again = alice.submit(spec, idempotency_key="notebook-cell-7")  # a retry: the same run
    assert again.status.name == "via-api"
    changed = tmp_path / "changed.toml"
    changed.write_text(spec.read_text().replace("steps = 40", "steps = 41"))
    for key in ("notebook-cell-7", None):  # under the same key, and under the same name
        error = refused(lambda k=key: alice.submit(changed, idempotency_key=k), 409, "conflict")
        # The keys that differ, not their values: the run holding the name may be another team's.
        assert error.message.endswith("it differs in train.steps") and "40" not in error.message
        assert error.field == "train.steps"
    renamed = tmp_path / "renamed.toml"
    renamed.write_text(spec.read_text().replace('name = "via-api"', 'name = "via-api-2"'))
    error = refused(lambda: alice.submit(renamed, idempotency_key="notebook-cell-7"), 409,
                    "conflict")  # fmt: skip
    assert "was used for run 'via-api'" in error.message

    phases, scraped_steps = [], []

    def seen(r: RunView) -> None:
        phases.append(r.status.phase.value)
        if r.status.phase.value == "TRAINING" and r.progress is not None:
            scraped_steps.append(
                value(scrape(url, dave_token), "forgeline_run_step", run="via-api")
            )

    run = dave.wait("via-api", progress=seen, timeout_s=240)
    assert run.status.phase.value == "AWAITING_APPROVAL", phases
    # Prometheus' view, scraped with a reader's token: the step rose while the gang trained,
    # the nodes are there, and the open run's goodput once it waits for approval.
    assert scraped_steps == sorted(scraped_steps) and scraped_steps[0] < 40, scraped_steps
    final = scrape(url, dave_token)
    assert value(final, "forgeline_run_step", run="via-api") == 40
    assert value(final, "forgeline_run_phase", run="via-api", phase="AWAITING_APPROVAL") == 1
    assert 0 < value(final, "forgeline_run_goodput_ratio", run="via-api") <= 1
    # The stack's twin site: the replicator's status, read from the twin, passes every 2 s.
    assert value(final, "forgeline_replication_status_readable") == 1
    assert value(final, "forgeline_replication_status_age_seconds") < 60
    # Each worker and agent serves its own metrics and the Temporal SDK's (run/NAME.metrics).
    served = endpoints(stack.home)
    assert {"control-worker", "data-0"} <= set(served), served
    control = scrape_process(served["control-worker"])
    assert any(n == "temporal_activity_execution_latency_count" and ("activity_type", "evaluate")
               in labels for n, labels in control), sorted({n for n, _ in control})  # fmt: skip
    for node in run.status.nodes:
        agent = scrape_process(served[node])
        assert value(agent, "forgeline_agent_cache_bytes", node=node) > 0  # the dataset
        assert value(agent, "forgeline_agent_health_check_failing", node=node) == 0
        trained = [v for (n, labels), v in agent.items()
                   if n == "temporal_activity_execution_latency_count"
                   and ("activity_type", "train_on_node") in labels]  # fmt: skip
        assert trained and trained[0] >= 1, node
    node_states = {dict(labels)["node"] for name, labels in final if name == "forgeline_node_state"}
    nodes = ClusterState.model_validate_json(stack.cli("nodes", "--json").stdout).nodes
    assert node_states == {n.info.node_id for n in nodes}
    assert run.status.last_checkpoint is not None and run.status.last_checkpoint.step == 40
    # The loss curve the ranks streamed to MLflow, through the API (the agents ship it within
    # seconds of each step).
    curve = wait_for(
        lambda: 40 in (steps := [p.step for p in dave.metrics("via-api", "train/loss")
                                 .series["train/loss"]]) and steps,
        60,
        "the last step's loss in the metrics",
    )  # fmt: skip
    assert curve == sorted(curve) and len(curve) >= 8, curve
    assert "train/tokens_per_s" in dave.metrics("via-api").series

    # Nobody approves their own run; an approver of another team may not; one of this team may.
    own = refused(lambda: alice.approve("via-api"), 403, "refused")
    assert "alice" in own.message, own
    other_team = refused(lambda: bob.approve("via-api"), 403, "forbidden")
    assert "approve:research" in (other_team.fix or "")
    decided = carol.approve("via-api", note="fine")
    assert decided.status.phase.value == "APPROVED" and decided.status.decision
    assert decided.status.decision.approver == "carol"
    refused(lambda: carol.approve("via-api"), 409, "wrong_phase")
    # The CLI's --json is the API's answer, field for field.
    printed = RunView.model_validate_json(stack.cli("status", "via-api", "--json").stdout)
    assert printed.status == dave.status("via-api").status
    listed = RunList.model_validate_json(stack.cli("runs", "--json").stdout)
    assert "via-api" in [r.status.name for r in listed.runs]
    state = ClusterState.model_validate_json(stack.cli("nodes", "--json").stdout)
    assert {n.info.node_id for n in state.nodes} == {n.info.node_id for n in dave.cluster().nodes}
    # One peak for the pretend nodes of one machine, measured by `up` before it started them
    # (this package's first tests run before any agent is restarted): agents that measured it
    # themselves beside the starting servers each got another figure, a third of it.
    assert len({n.info.peak_flops for n in state.nodes}) == 1, state.nodes
    lineage = dave.lineage("via-api", "@production")
    assert not lineage.broken and "approved by carol" in lineage.links[0].detail, lineage
    assert {"checkpoint", "dataset"} <= {k.what for k in lineage.links if k.check == "ok"}
    refused(lambda: dave.status("no-such-run"), 404, "not_found")

    # The model is research's now: a run of another team may not add versions to it.
    admin = Client(url, (stack.home / LOCAL_TOKEN_FILE).read_text().strip())  # `up` made it
    poach = variant(tmp_path, "poacher", team="vision", registry={"model_name": "via-api"})
    error = refused(lambda: admin.submit(poach), 403, "forbidden")
    assert error.field == "registry.model_name" and "team 'research'" in error.message

    # Anyone who reaches Temporal can signal a run: a grant the cluster never made (a made-up
    # generation, on a node of its choosing) is refused, noted, and changes nothing.
    alice.submit(variant(tmp_path, "via-api-long", team="research", steps=100_000))
    asyncio.run(forge_a_grant(stack, "via-api-long"))
    trained = wait_for(
        lambda: (r := dave.status("via-api-long")).status.phase.value == "TRAINING" and r,
        120,
        "the run to train",
        poll=0.5,
    )
    assert trained.status.generation != FORGED_GENERATION, trained.status
    assert any("generation 999 on node-2" in g for g in trained.status.refused_grants)

    # A run is cancelled by its owner or an operator, and by nobody else; so are nodes.
    refused(lambda: dave.cancel("via-api-long"), 403, "forbidden")
    assert alice.cancel("via-api-long").status.phase.value == "CANCELLED"
    node = dave.cluster().nodes[0].info.node_id
    request = urllib.request.Request(f"{url}/v1/nodes/{node}/drain", method="POST",
                                     headers={"Authorization": f"Bearer {dave.token}"})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(request, timeout=30)
    assert raw.value.code == 403 and "operate" in json.loads(raw.value.read())["error"]["message"]
    assert all(n.admin.value == "active" for n in dave.cluster().nodes)

    # The local user's admin token lists every token; revoking one shuts its bearer out.
    listed = stack.cli("tokens", "list").stdout
    assert "alice" in listed and "submit:research" in listed and "e2e" in listed
    stack.cli("tokens", "revoke", dave.whoami().token_id)
    refused(dave.runs, 401, "unauthenticated")
    assert admin.whoami().roles == ["admin"]


def test_the_schema_in_the_repository_is_the_one_served(stack: Stack) -> None:
    with urllib.request.urlopen(stack.settings.api_url + "/openapi.json", timeout=30) as answer:
        served = json.loads(answer.read())
    assert json.loads(SCHEMA.read_text()) == served, (
        "docs/openapi.json is stale: python -m worker.api_schema > docs/openapi.json"
    )


# The join_node validator is tested on the workflow in seconds (tests/workflows/
# test_cluster_workflow.py); this repeats it with real agents, out of make test's 15 minutes.
@pytest.mark.slow
def test_a_second_agent_under_a_live_node_s_id_is_refused(stack: Stack, tmp_path: Path) -> None:
    """Another host started with a live node's --node-id (a copied config, say) is refused by
    the cluster, and so is a second agent from the node's own state folder; the node is as it
    was."""
    before = ClusterState.model_validate_json(stack.cli("nodes", "--json").stdout).nodes[0]
    settings = stack.settings
    elsewhere = {**stack.env, "FORGELINE_HOME": str(tmp_path / "another-host"),
                 "FORGELINE_TEMPORAL_ADDRESS": settings.temporal_address,
                 "FORGELINE_MLFLOW_URI": settings.mlflow_uri}  # fmt: skip
    agent = [FORGELINE, "agent", "--node-id", before.info.node_id, "--gpus", "1"]
    for env, says in [
        (elsewhere, f"node {before.info.node_id} is alive under another agent"),
        (stack.env, f"node {before.info.node_id}'s agent (pid "),
    ]:
        done = subprocess.run(agent, env=env, capture_output=True, text=True, timeout=180)
        assert done.returncode == ExitCode.REFUSED, done.stdout + done.stderr[-3000:]
        assert says in done.stdout, done.stdout
    after = ClusterState.model_validate_json(stack.cli("nodes", "--json").stdout).nodes[0]
    assert (after.info.incarnation, after.health) == (before.info.incarnation, before.health)
