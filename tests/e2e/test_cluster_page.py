"""The cluster page at the API's `/`, loaded in headless Chromium (Debian's `chromium`) while a
run trains and another waits: the nodes, the gang and the queue are on the screen, asserted on
the DOM the page's script built; a screenshot is kept under reports/test-artifacts/."""

from __future__ import annotations

import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from forgeline import Client
from tests.conftest import REPO
from tests.e2e.conftest import Stack, variant, wait_for
from workflows.contracts.cluster_models import ClusterState

ARTIFACTS = Path(os.environ.get("FORGELINE_TEST_ARTIFACTS", REPO / "reports" / "test-artifacts"))


class Rows(HTMLParser):
    """The text of every table row that carries one of the page's data attributes."""

    KEYS = ("data-node", "data-gang", "data-waiting", "data-run")

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[tuple[str, str], str] = {}
        self._open: tuple[str, str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = [(k, v) for k, v in attrs if k in self.KEYS and v is not None]
        if tag == "tr" and found:
            self._open = found[0]  # type: ignore[assignment]
            self.rows[self._open] = ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr":
            self._open = None

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self.rows[self._open] += data + " "


def chromium(profile: Path, *args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("chromium")
    if binary is None:
        pytest.skip("chromium is missing: apt-get install chromium (CI's .ci/run installs it)")
    # --virtual-time-budget: the page's script runs its first refresh (the requests it waits
    # on) before the DOM is dumped or the screenshot taken.
    command = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
               f"--user-data-dir={profile}", "--virtual-time-budget=8000", *args]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


# What the page is given is tested in seconds (tests/worker/test_fleet_view.py); the page itself,
# in Chromium with a gang training, runs with the slow tests (make test's 15 minutes).
@pytest.mark.slow
def test_the_page_shows_the_nodes_the_gang_and_the_queue(stack: Stack, tmp_path: Path) -> None:
    training, waiting = "page-training", "page-waiting"
    try:
        stack.cli("run", str(variant(tmp_path, training, steps=100000)), "--detach")
        # Two nodes of three train; a second two-node run waits, with its reason.
        wait_for(lambda: _gang(_state(stack), training), 120, "the first gang")
        stack.cli("run", str(variant(tmp_path, waiting, steps=40)), "--detach")
        wait_for(lambda: [w for w in _state(stack).waiting if w.run_id == waiting], 120,
                 "the second run to wait")  # fmt: skip
        state = _state(stack)
        url = f"{stack.settings.api_url}/#token={stack.token('on-call', 'read')}"

        dom = chromium(tmp_path / "dump", "--dump-dom", url).stdout
        parser = Rows()
        parser.feed(dom)
        rows = parser.rows
        for node in state.nodes:
            assert ("data-node", node.info.node_id) in rows, (node.info.node_id, sorted(rows))
            assert node.state in rows[("data-node", node.info.node_id)]
        assert ("data-gang", training) in rows, dom[-3000:]
        gang = rows[("data-gang", training)]
        assert "TRAINING" in gang, gang
        assert all(n.node_id in gang for n in _gang(state, training)), gang
        reason = next(w.reason for w in state.waiting if w.run_id == waiting)
        assert reason.split(":")[0] in rows[("data-waiting", waiting)], rows
        assert ("data-run", training) in rows and ("data-run", waiting) in rows

        # A run's detail: its gang attempts and its loss curve, drawn from the API's answers,
        # once the ranks' loss has reached MLflow at two steps at least (shipped within seconds).
        reader = Client(stack.settings.api_url, stack.token("on-call", "read"))
        wait_for(lambda: len(reader.metrics(training, "train/loss").series.get("train/loss", []))
                 >= 2, 120, "two loss points in MLflow")  # fmt: skip
        detail = chromium(tmp_path / "detail", "--dump-dom", f"{url}&run={training}").stdout
        assert f"{training}: TRAINING" in detail, detail[-3000:]
        assert "<polyline" in detail, detail[-3000:]
        assert ": running (after the last)" in detail  # the gang now training, on the timeline
        assert 'id="detail" hidden' not in detail

        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "cluster-page.png"
        shot.unlink(missing_ok=True)
        chromium(tmp_path / "shot", "--window-size=1400,1500", f"--screenshot={shot}",
                 f"{url}&run={training}")  # fmt: skip
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    finally:
        for run in (training, waiting):
            stack.cli("cancel", run, check=False)


def test_the_page_holds_no_data_and_asks_for_a_token(stack: Stack, tmp_path: Path) -> None:
    dom = chromium(tmp_path / "none", "--dump-dom", stack.settings.api_url + "/").stdout
    parser = Rows()
    parser.feed(dom)
    assert parser.rows == {}  # no node, gang, queue or run drawn
    assert '<form id="login">' in dom and 'id="page" hidden' in dom


def _state(stack: Stack) -> ClusterState:
    return ClusterState.model_validate_json(stack.cli("nodes", "--json").stdout)


def _gang(state: ClusterState, run: str) -> list:
    return [n for a in state.allocations if a.run_id == run for n in a.nodes]
