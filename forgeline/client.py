"""The client of Forgeline's HTTP API, for notebooks, CI pipelines and other programs:

    from forgeline import Client

    client = Client()                      # FORGELINE_API_URL / FORGELINE_TOKEN, or this stack's
    run = client.submit("examples/tiny.toml", idempotency_key="cell-7")
    run = client.wait(run.status.name, progress=lambda r: print(r.status.phase))
    client.approve(run.status.name, note="looks right")   # as the token's person

Answers are the API's own models (workflows.contracts.api_models): a run is a `RunView` with the
workflow's `RunStatus`. A refusal raises `ApiError` with the API's code, field and fix.
"""

from __future__ import annotations

import os
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from infra import code_snapshot
from infra.settings import load_settings
from infra.tokens import caller_token
from registry.approvals import ApprovalsFile
from workflows.contracts import api_models as wire
from workflows.contracts.cluster_models import ClusterConfig, ClusterState, Node
from workflows.contracts.models import CodeRef, Phase

M = TypeVar("M", bound=BaseModel)
# Phases a run waits in for a person or ends in: `wait` returns at the first of them.
_SETTLED = {Phase.AWAITING_APPROVAL} | {p for p in Phase if p.final}
_REMOTE = ("s3://", "store:")


class ApiError(Exception):
    """The API refused a request: `status` (HTTP), `code` (stable, for programs), `field` (what
    was at fault, when one was) and `fix` (what to do)."""

    def __init__(self, status: int, code: str, message: str, field: str | None, fix: str | None):
        super().__init__(f"{message}" + (f" ({fix})" if fix else ""))
        self.status, self.code, self.message, self.field, self.fix = (
            status, code, message, field, fix,
        )  # fmt: skip


class Client:
    def __init__(self, url: str | None = None, token: str | None = None, timeout_s: float = 180):
        """`url` and `token` default to FORGELINE_API_URL and FORGELINE_TOKEN, then to the local
        stack's (the state folder's stack.json and token, as `forgeline up` wrote them)."""
        settings = load_settings()  # FORGELINE_API_URL, else the stack's
        self.url = (url or settings.api_url).rstrip("/")
        self.token = token or caller_token(settings.home)  # FORGELINE_TOKEN, else the stack's
        self.timeout_s = timeout_s

    def whoami(self) -> wire.WhoAmI:
        return self._call("GET", "/v1/whoami", answer=wire.WhoAmI)

    def submit(
        self, spec: dict[str, Any] | str | Path, idempotency_key: str | None = None
    ) -> wire.RunView:
        """Start a run from a spec (a dict, or a spec file whose relative paths are resolved
        against its folder), or get the run this spec already started. A spec's train.code
        folder is uploaded first (`upload_code`)."""
        return self.start(spec, idempotency_key).run

    def start(
        self, spec: dict[str, Any] | str | Path, idempotency_key: str | None = None
    ) -> wire.SubmitAnswer:
        """`submit`, with the API's whole answer: `created` is true when this call started it."""
        data = spec if isinstance(spec, dict) else _spec_file(Path(spec))
        train = data.get("train")
        folder = train.get("code") if isinstance(train, dict) else None
        code = self.upload_code(Path(folder)) if isinstance(folder, str) and folder else None
        body = wire.SubmitRequest(spec=data, code=code)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._call("POST", "/v1/runs", body, wire.SubmitAnswer, headers)

    def upload_code(self, folder: Path) -> CodeRef:
        """A train.code folder as a snapshot in the platform's store (the files `.gitignore`
        leaves in); the API's id must be the one these files make, or nothing is submitted."""
        data, expected = code_snapshot.pack(folder)
        code = self._call("POST", "/v1/code", answer=CodeRef, raw=data)
        if code.snapshot_id != expected:
            message = f"the API stored {folder} as snapshot {code.snapshot_id}, not {expected}"
            raise ApiError(0, "corrupt_upload", message, "code", "submit again")
        return code

    def status(self, name: str) -> wire.RunView:
        return self._call("GET", f"/v1/runs/{_segment(name)}", answer=wire.RunView)

    def runs(self) -> list[wire.RunView]:
        return self._call("GET", "/v1/runs", answer=wire.RunList).runs

    def metrics(self, name: str, *keys: str) -> wire.Metrics:
        """The run's metric series (`train/loss`, …; every one when no key is given)."""
        query = urllib.parse.urlencode([("key", k) for k in keys])
        path = f"/v1/runs/{_segment(name)}/metrics" + (f"?{query}" if query else "")
        return self._call("GET", path, answer=wire.Metrics)

    def logs(
        self,
        name: str,
        attempt: int | None = None,
        node: str | None = None,
        rank: int | None = None,
        after: Sequence[str] = (),
    ) -> wire.RunLogs:
        """The run's ranks' and torchrun's output (the latest attempt unless one is given);
        `after` holds NODE/FILE:OFFSET of the last piece read of each file, to follow it."""
        chosen = {"attempt": attempt, "node": node, "rank": rank}
        query = [(k, str(v)) for k, v in chosen.items() if v is not None]
        query += [("after", cursor) for cursor in after]
        path = f"/v1/runs/{_segment(name)}/logs"
        if query:
            path += f"?{urllib.parse.urlencode(query)}"
        return self._call("GET", path, answer=wire.RunLogs)

    def wait(
        self,
        name: str,
        progress: Callable[[wire.RunView], None] | None = None,
        poll_s: float = 1.0,
        timeout_s: float | None = None,
    ) -> wire.RunView:
        """Until the run waits for a decision or ends; `progress` sees every answer whose
        phase or step changed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        last: tuple = ()
        while True:
            run = self.status(name)
            seen = (run.status.phase, run.progress.step if run.progress else None)
            if progress is not None and seen != last:
                progress(run)
                last = seen
            if run.status.phase in _SETTLED:
                return run
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run {name} is still {run.status.phase.value}")
            time.sleep(poll_s)

    def cancel(self, name: str, wait_s: float = 120) -> wire.RunView:
        """Stop the run's ranks and release its gang; waits up to `wait_s` for them to stop."""
        path = f"/v1/runs/{_segment(name)}/cancel?wait_s={wait_s:g}"
        return self._call("POST", path, answer=wire.RunView)

    def resume(
        self, name: str, from_step: int | None = None, nodes: int | None = None
    ) -> wire.RunView:
        """A FAILED or CANCELLED run trains on from its last committed checkpoint; with
        `from_step`, any run that has ended trains on from the checkpoint it keeps at that
        step; with `nodes`, on that many nodes."""
        body = wire.ResumeRequest(from_step=from_step, nodes=nodes)
        return self._call("POST", f"/v1/runs/{_segment(name)}/resume", body, wire.RunView)

    def approve(self, name: str, note: str = "", override_gate: bool = False) -> wire.RunView:
        body = wire.ApproveRequest(note=note, override_gate=override_gate)
        return self._call("POST", f"/v1/runs/{_segment(name)}/approve", body, wire.RunView)

    def reject(self, name: str, reason: str) -> wire.RunView:
        body = wire.RejectRequest(reason=reason)
        return self._call("POST", f"/v1/runs/{_segment(name)}/reject", body, wire.RunView)

    def lineage(self, model: str, version: str) -> wire.Lineage:
        """A version (a number, or `@production`) traced to its checkpoint, data and code, every
        hash checked against the store as it is now."""
        path = f"/v1/models/{_segment(model)}/versions/{_segment(version)}/lineage"
        return self._call("GET", path, answer=wire.Lineage)

    def cluster(self) -> ClusterState:
        return self._call("GET", "/v1/cluster", answer=ClusterState)

    def node(self, node_id: str, action: str) -> Node:
        """`drain` (its gangs checkpoint and move), `cordon` (no new work) or `undrain`."""
        return self._call("POST", f"/v1/nodes/{_segment(node_id)}/{_segment(action)}",
                          answer=Node)  # fmt: skip

    def apply_cluster(self, config: ClusterConfig) -> ClusterConfig:
        return self._call("PUT", "/v1/cluster/config", config, ClusterConfig)

    def approvals(self) -> ApprovalsFile:
        return self._call("GET", "/v1/approvals", answer=ApprovalsFile)

    def apply_approvals(self, rules: ApprovalsFile) -> ApprovalsFile:
        return self._call("PUT", "/v1/approvals", rules, ApprovalsFile)

    def _call(
        self,
        method: str,
        path: str,
        body: BaseModel | None = None,
        answer: type[M] = BaseModel,  # type: ignore[assignment]
        headers: dict[str, str] | None = None,
        raw: bytes | None = None,
    ) -> M:
        request = urllib.request.Request(
            self.url + path,
            method=method,
            data=raw if raw is not None else (body.model_dump_json().encode() if body else None),
            headers={
                "Content-Type": "application/x-tar" if raw is not None else "application/json",
                **({"Authorization": f"Bearer {self.token}"} if self.token else {}),
                **(headers or {}),
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                return answer.model_validate_json(reply.read())
        except urllib.error.HTTPError as err:
            raw = err.read()
            try:
                detail = wire.ErrorBody.model_validate_json(raw).error
            except ValueError:  # not the API's shape: a proxy's page, say
                raise ApiError(err.code, "http_error", raw[:300].decode(errors="replace"),
                               None, None) from None  # fmt: skip
            raise ApiError(
                err.code, detail.code, detail.message, detail.field, detail.fix
            ) from None
        except urllib.error.URLError as err:
            fix = "start the stack with `forgeline up`, or set FORGELINE_API_URL"
            message = f"cannot reach {self.url}: {err.reason}"
            raise ApiError(0, "unreachable", message, None, fix) from None


def _segment(text: str) -> str:
    """One path segment, whatever it holds: the API, not the URL, refuses a bad name."""
    return urllib.parse.quote(text, safe="@")


def _spec_file(path: Path) -> dict[str, Any]:
    """A spec file's keys, with local data sources made absolute against the file's folder
    (the API has no folder of its own to resolve them against)."""
    spec = tomllib.loads(path.read_text())
    folder = path.resolve().parent
    data = spec.get("data")
    if isinstance(data, dict) and isinstance(data.get("sources"), list):
        data["sources"] = [
            s if not isinstance(s, str) or s.startswith(_REMOTE) else os.path.join(folder, s)
            for s in data["sources"]
        ]
    train = spec.get("train")
    if isinstance(train, dict) and isinstance(train.get("code"), str) and train["code"]:
        train["code"] = os.path.abspath(os.path.join(folder, train["code"]))
    return spec
