"""A private local stack for the benchmarks that drive Forgeline end to end (bench.recovery,
bench.soak): `forgeline up` on free ports in a state folder of its own, the CLI and the HTTP
API as its admin, the ranks' progress files, the store."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from forgeline.client import Client
from infra.settings import load_settings
from infra.store.protocol import ObjectStore
from infra.tokens import caller_token
from worker.stack import free_port_flags
from workflows.contracts.models import RunStatus

FORGELINE = str(Path(sys.executable).parent / "forgeline")
_NOT_INHERITED = ("FORGELINE_", "AWS_", "MLFLOW_")


class LocalStack:
    def __init__(self, home: Path, settings: dict[str, str]) -> None:
        self.home = home
        # Private: none of the caller's Forgeline, store or MLflow settings. A test run after
        # the e2e stack's had that stack's MLflow login in its environment, and the soak's
        # control worker signed in to its own MLflow with it (401 on every registration).
        own = {k: v for k, v in os.environ.items() if not k.startswith(_NOT_INHERITED)}
        self.env = {**own, "FORGELINE_HOME": str(home), **settings}

    def cli(self, *args: str, timeout: float = 600) -> str:
        done = subprocess.run(
            [FORGELINE, *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            raise RuntimeError(f"forgeline {' '.join(args)}: {done.stdout}{done.stderr[-2000:]}")
        return done.stdout

    def up(self, nodes: int) -> None:
        """`forgeline up` on free ports, once more on others if one was taken before the
        server bound it (a free port is only free when asked: the stack before this one
        still had processes exiting, and Temporal once failed on 'address already in use')."""
        for attempt in (1, 2):
            try:
                self.cli("up", "--nodes", str(nodes), "--gpus-per-node", "1", *free_port_flags())
                return
            except RuntimeError:
                self.cli("down")
                if attempt == 2:
                    raise

    def generations(self, run: str) -> list[int]:
        """The generations of `run` whose ranks ran on some node of this stack, oldest first."""
        found = self.home.glob(f"nodes/*/runs/{run}/gen-*")
        return sorted({int(folder.name.removeprefix("gen-")) for folder in found})

    def events(self, run: str, generation: int) -> list[dict]:
        """The progress lines the ranks of one generation of `run` wrote, on every node, in
        time order (a line being written is left out)."""
        found = []
        for path in self.home.glob(f"nodes/*/runs/{run}/gen-{generation}/progress.jsonl"):
            found += [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]
        return sorted(found, key=lambda e: e["time"])

    def status(self, run: str) -> RunStatus:
        return asyncio.run(_query_status(self.home, run))

    def api(self) -> Client:
        """The HTTP API as the stack's admin (the token `up` made for the local user)."""
        settings = load_settings(self.home)
        return Client(settings.api_url, caller_token(self.home))

    def store(self) -> ObjectStore:
        """The store as the stack's processes see it (from the same environment)."""
        previous = dict(os.environ)
        os.environ.update(self.env)
        try:
            return load_settings(self.home).open_store()
        finally:
            os.environ.clear()
            os.environ.update(previous)


async def _query_status(home: Path, run: str) -> RunStatus:
    from worker.temporal_client import connect

    client = await connect(load_settings(home))
    return await client.get_workflow_handle(run).query("status", result_type=RunStatus)
