"""Sources per team (worker/team_sources.py): a team whose queue lists its sources reads only
those, and names only its listed S3 endpoints; a team without a list reads what it read before.
Checked as a function, and through the API in-process: an unlisted endpoint is refused before
anything is sent to it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from infra.processes import free_port
from infra.settings import Settings
from infra.tokens import TokenStore
from tests.asgi_call import call
from tests.worker.test_source_check import held  # noqa: F401  (a fixture)
from worker.api import make_app
from worker.api_rules import ApiError
from worker.team_sources import refuse_sources_outside_team
from workflows.contracts.cluster_models import ClusterConfig, QueueConfig
from workflows.contracts.spec import RunSpec

ENDPOINT = "https://s3.internal:9000"


def _nlp(root: Path) -> QueueConfig:
    """As a cluster file declares it (trailing '/' and all)."""
    return ClusterConfig.model_validate({"queues": [{
        "name": "nlp",
        "sources": [f"{root}/nlp/", "store:datasets-in/nlp/", "s3://nlp-corpora/raw/"],
        "s3_endpoints": [f"{ENDPOINT}/"],
    }]}).queue("nlp")  # fmt: skip


def _spec(*sources: str, team: str = "nlp") -> RunSpec:
    return RunSpec.model_validate(
        {"name": "r1", "data": {"sources": list(sources)}, "resources": {"team": team}}
    )


def _refused(queue: QueueConfig, source: str) -> ApiError:
    with pytest.raises(ApiError) as refused:
        refuse_sources_outside_team(_spec(source), queue)
    assert (refused.value.status, refused.value.detail.field) == (403, "data.sources")
    return refused.value


def test_a_team_reads_only_its_listed_sources_and_endpoints(tmp_path: Path) -> None:
    queue = _nlp(tmp_path)
    (tmp_path / "nlp").mkdir()
    (tmp_path / "vision").mkdir()
    listed = [f"{tmp_path}/nlp/web/*.jsonl", f"{tmp_path}/nlp", "store:datasets-in/nlp/a.txt",
              "store:datasets-in/nlp/**/*.jsonl", "s3://nlp-corpora/raw/",
              f"s3://nlp-corpora/raw/part-?.jsonl?endpoint={ENDPOINT}"]  # fmt: skip
    for source in listed:
        refuse_sources_outside_team(_spec(source), queue)

    (tmp_path / "nlp" / "theirs").symlink_to(tmp_path / "vision")
    outside = [f"{tmp_path}/vision/a.txt", f"{tmp_path}/*/a.txt", f"{tmp_path}/nlp-private",
               f"{tmp_path}/nlp/theirs/a.txt", "store:datasets-in/nlp-private/a.txt",
               "store:datasets-in/*", "store:datasets-in/nlp/../vision/a.txt",
               "s3://vision-corpora/raw/", "s3://nlp-corpora/*/x.jsonl"]  # fmt: skip
    for source in outside:
        error = _refused(queue, source)
        assert error.detail.message.startswith(f"data.sources: {source} is not among the sources "
                                               "of team 'nlp'"), source  # fmt: skip
        assert "`sources` of its queue in the cluster file" in error.detail.message
        assert error.detail.fix is not None and "queue 'nlp'" in error.detail.fix

    for endpoint in ("http://169.254.169.254", "https://s3.internal:9001"):
        error = _refused(queue, f"s3://nlp-corpora/raw/?endpoint={endpoint}")
        assert f"names the endpoint {endpoint}, which is not among the S3 endpoints of team " \
               "'nlp'" in error.detail.message  # fmt: skip
        assert "`s3_endpoints` of its queue" in error.detail.message


def test_a_team_without_a_list_reads_what_it_did_before(tmp_path: Path) -> None:
    anything = [f"{tmp_path}/vision/a.txt", "store:runs/", "s3://any/x?endpoint=http://10.0.0.1"]
    refuse_sources_outside_team(_spec(*anything, team="vision"), _nlp(tmp_path).model_copy(
        update={"name": "vision", "sources": None, "s3_endpoints": None}))  # fmt: skip
    # Endpoints alone may be listed: the sources stay open, the endpoints do not.
    only_endpoints = QueueConfig(name="nlp", s3_endpoints=[ENDPOINT])
    refuse_sources_outside_team(_spec(*anything[:2]), only_endpoints)
    refused = _refused(only_endpoints, anything[2])
    assert "it may name https://s3.internal:9000" in refused.detail.message


@pytest.mark.parametrize(
    "entry", ["data/nlp", "/data/*", "/data/../etc", "store:/abs", "s3://", "s3://b/x?endpoint=y"]
)
def test_a_listed_source_is_a_place_not_a_pattern(entry: str) -> None:
    with pytest.raises(ValueError, match="sources"):
        QueueConfig(name="nlp", sources=[entry])
    with pytest.raises(ValueError, match="not an endpoint"):
        QueueConfig(name="nlp", s3_endpoints=["https://key:secret@s3.internal"])


def test_the_api_refuses_an_unlisted_endpoint_before_sending_it_anything(
    tmp_path: Path,
    held,  # noqa: F811
) -> None:
    listing, source = held  # an S3 server that records being asked
    settings = Settings(
        home=tmp_path / "home",
        temporal_address=f"127.0.0.1:{free_port()}",
        store_url=f"file://{tmp_path / 'store'}",
        data_roots=str(tmp_path),
    )
    token, _ = TokenStore(settings.home).create("alice", ["submit:nlp"], created_by="test")
    headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}

    async def applied() -> ClusterConfig:
        return ClusterConfig(queues=[_nlp(tmp_path)])

    app = make_app(settings, cluster_config=applied)
    (tmp_path / "nlp").mkdir()
    (tmp_path / "nlp" / "a.txt").write_text("To be.\n")

    def submit(source: str) -> tuple[int, dict]:
        spec = {"name": "x", "data": {"sources": [source]}, "resources": {"team": "nlp"}}
        body = json.dumps({"spec": spec}).encode()
        answer = asyncio.run(call(app, "POST", "/v1/runs", headers, [body]))
        return answer.status, answer.json().get("error", {})

    status, error = submit(source)
    assert (status, error["field"]) == (403, "data.sources") and "endpoint" in error["message"]
    assert not listing.asked.is_set()
    status, error = submit(f"{tmp_path}/a.txt")  # inside the data roots, not the team's folder
    assert (status, error["field"]) == (403, "data.sources")
    assert submit(f"{tmp_path}/nlp/a.txt")[0] == 503  # listed: checked, on to Temporal
