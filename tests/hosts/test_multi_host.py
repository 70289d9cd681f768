"""Across real network interfaces: a gang of two hosts trains over the bridge (its peer-tier
checkpoints too), survives one host's cable being pulled, and its logs are read from
elsewhere."""

from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path

import pytest
import torch

from infra.store.protocol import ObjectStore
from tests.e2e.conftest import alive, fetched_checkpoint, variant, wait_for
from tests.e2e.faults import gang_of
from tests.hosts.conftest import Cluster
from tests.hosts.netns import Host
from trainer.evaluate import load_model
from trainer.manifest import Fences, commits, committed_steps, find_latest
from worker.chaos import trainer_processes
from worker.cli_common import ExitCode

# With the slow tests, to keep `make test` within 15 minutes (the hosts take a minute to build):
# what runs on them, a gang's rendezvous, training, peer tier and store door, runs in make test
# on one host's loopback (tests/e2e); the arguments that bind an interface, in test_fabric.py.
pytestmark = pytest.mark.slow

STEPS, CHECKPOINT_EVERY, PEER_EVERY = 300, 50, 10


def spec(tmp_path: Path, name: str) -> Path:
    """examples/tiny.toml under another name, long enough to be cut mid-run, with peer-tier
    checkpoints between the store's (sent host to host over the bridge); a silent host is
    given up on at its activity's heartbeat timeout, 5 s."""
    return variant(tmp_path, name, steps=STEPS, checkpoint_every=CHECKPOINT_EVERY,
                   peer_every=PEER_EVERY, heartbeat_timeout_s=5)  # fmt: skip


def weights(store: ObjectStore, run: str, scratch: Path) -> dict[str, torch.Tensor]:
    folder, manifest = fetched_checkpoint(store, run, scratch)
    return load_model(folder, manifest.network).state_dict()


def progress(cluster: Cluster, run: str) -> list[dict]:
    """Every progress line of the run's ranks, on every host."""
    lines = []
    for host in cluster.network.hosts:
        for path in cluster.home_of(host).glob(f"nodes/*/runs/{run}/gen-*/progress.jsonl"):
            lines += [json.loads(line) for line in path.read_text().splitlines()]
    return lines


def peer_step(store: ObjectStore, run: str) -> int:
    """The step of the run's peer checkpoint in the store (0: none)."""
    steps = [int(k.split("/step-")[1].split("/")[0]) for k in store.list(f"runs/{run}/peer/")]
    return max(steps, default=0)


def ranks_on(cluster: Cluster, host: Host, run: str) -> list[int]:
    return [p for p in trainer_processes(cluster.home_of(host), run=run) if alive(p)]


@pytest.fixture(scope="module")
def clean(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A fault-free two-host run, which the partitioned one is compared with."""
    followed = cluster.cli("run", str(spec(tmp_path_factory.mktemp("clean"), "clean")), timeout=400)
    assert "AWAITING_APPROVAL" in followed.stdout, followed.stdout + cluster.log_tails()
    return "clean"


def test_a_gang_of_two_hosts_trains_across_the_bridge(cluster: Cluster, clean: str) -> None:
    """Two hosts' ranks rendezvous at the head's bridge address, train with gloo on their own
    interfaces (no loopback reaches from one namespace to another), checkpoint to S3 and end
    awaiting approval; `forgeline logs` reads both ranks' lines from the root namespace."""
    assert committed_steps(cluster.store(), clean)[0] == STEPS
    addresses = {h.name: h.address for h in cluster.network.hosts}
    for rank in (0, 1):
        logs = cluster.cli("logs", clean, "--rank", str(rank)).stdout
        (head,) = re.findall(
            rf"\[rank {rank}/2 gen \d+\] on (h\d), .* gloo over (\S+), store at ([\d.]+):\d+",
            logs,
        )
        host, interface, store_at = head
        assert interface.startswith("flp") and interface.endswith(host), head
        assert store_at in addresses.values(), head  # the head's bridge address, not loopback
        assert re.search(rf"\[rank {rank}/2 gen \d+\] step {STEPS}/{STEPS} loss", logs), logs
    # The newest peer checkpoint: each host holds its own shards and the other's, sent over the
    # bridge, and nothing older.
    store = cluster.store()
    (key,) = store.list(f"runs/{clean}/peer/")
    files = json.loads(store.get_bytes(key))["files"]
    assert all(len(set(f["holders"])) == 2 for f in files), files
    gang = {holder for f in files for holder in f["holders"]}
    for host in (h for h in cluster.network.hosts if h.name in gang):
        folder = cluster.home_of(host) / "nodes" / host.name / "runs" / clean / "peer-copies"
        held = {f["sha256"] for f in files if host.name in f["holders"]}
        assert {p.name for p in folder.iterdir()} == held and held, (host.name, files)
    assert len(gang) == 2, files


def test_a_gpu_type_no_agent_reports_is_refused_before_the_run_starts(
    cluster: Cluster, tmp_path: Path
) -> None:
    path = spec(tmp_path, "wants-h100")
    path.write_text(path.read_text().replace("[resources]\n", '[resources]\ngpu_type = "h100"\n'))
    refused = cluster.cli("run", str(path), check=False)
    assert refused.returncode == ExitCode.BAD_INPUT, refused.stdout
    assert "resources.gpu_type = 'h100' is a type no node reports: the nodes report cpu" in (
        refused.stdout
    )
    assert "no run named" in cluster.cli("status", "wants-h100", check=False).stdout
    # Where each agent said its node sits (--topology), as the cluster holds it.
    nodes = cluster.cli("nodes").stdout
    for host in cluster.network.hosts:
        assert re.search(rf"{host.name} .* block=b0, rack=r-{host.name} ", nodes), nodes


# A dead node's recovery and fencing run faster on one host (tests/e2e/test_failures.py,
# tests/trainer's fencing tests).
def test_a_partitioned_host_is_replaced_and_its_ranks_commit_nothing(
    cluster: Cluster, clean: str, tmp_path: Path
) -> None:
    """One training host's link goes down mid-run (not a SIGKILL: its processes live on). The
    run notices, resumes on the third host from the newest peer checkpoint (the survivor sends
    the third host the cut-off host's shards over the bridge); when the link is
    back the cut-off ranks are fenced and commit nothing, and the final weights are those of a
    fault-free run. The cut-off host's log lines are read from the root namespace."""
    path = spec(tmp_path, "cut")
    cluster.cli("run", str(path), "--detach")
    store = cluster.store()
    generation, nodes = wait_for(lambda: (g := gang_of(cluster, "cut"))[0] and g, 120, "a gang")
    wait_for(lambda: committed_steps(store, "cut"), 120, "the first checkpoint", 0.05)
    # And a peer checkpoint after it: the new gang resumes from that one, its missing shards
    # sent over the bridge by the host that kept them.
    peer = wait_for(lambda: (p := peer_step(store, "cut")) > CHECKPOINT_EVERY and p, 120,
                    "a peer checkpoint", 0.05)  # fmt: skip
    victim = next(h for h in cluster.network.hosts if h.name == nodes[1])
    cut_at = time.monotonic()
    victim.cut()
    try:
        try:
            regrouped = wait_for(
                lambda: (g := gang_of(cluster, "cut"))[0] > generation and g, 120, "a new gang", 0.5
            )
        except AssertionError as err:
            raise AssertionError(
                f"{err}\n{cluster.cli('status', 'cut').stdout}\n{cluster.cli('nodes').stdout}"
                f"\n{cluster.log_tails()}"
            ) from None
        recovered_s = time.monotonic() - cut_at
        assert victim.name not in regrouped[1], regrouped
    finally:
        victim.mend()
    followed = cluster.cli("run", str(path), timeout=400)
    assert "AWAITING_APPROVAL" in followed.stdout, followed.stdout + cluster.log_tails()

    # Back on the network, the old ranks find their gang gone and exit without committing.
    wait_for(lambda: not ranks_on(cluster, victim, "cut"), 120, "the cut-off ranks to exit")
    fences = Fences.read(store, "cut")
    for commit in commits(store, "cut"):
        manifest = json.loads(store.get_bytes(commit.key))
        assert fences.why_stale(manifest["generation"], commit.step) is None, (commit, manifest)
    final, expected = (find_latest(store, run, max_generation=10**9) for run in ("cut", clean))
    assert final is not None and expected is not None and final.generation > generation
    assert final.manifest.loss_history == expected.manifest.loss_history
    mine, theirs = weights(store, "cut", tmp_path), weights(store, clean, tmp_path)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)

    resumed = cluster.cli("logs", "cut", "--attempt", str(regrouped[0])).stdout
    said = set(re.findall(r"\[rank (\d)/2 gen \d+\] resuming from the peer tier at step (\d+)",
                          resumed))  # fmt: skip
    (step,) = {int(step) for _, step in said}
    assert {rank for rank, _ in said} == {"0", "1"} and step >= peer, resumed[-3000:]
    cut_off = cluster.cli("logs", "cut", "--node", victim.name, "--attempt", str(generation))
    assert re.search(rf"\[rank \d/2 gen {generation}\] step \d+/{STEPS} loss", cut_off.stdout), (
        cut_off.stdout[-3000:]
    )
    # What it cost across the bridge, for the record (pytest -s shows it).
    events = progress(cluster, clean)
    # A gang's step takes as long as its slowest rank's.
    steps = [max(e["rank_step_s"]) for e in events if e["event"] == "step" and e["rank_step_s"]]
    commit_s = [e["seconds"] for e in events if e["event"] == "checkpoint" and e["manifest_key"]]
    print(
        f"\nacross the bridge: step {statistics.median(steps) * 1e3:.1f} ms (median), checkpoint "
        f"commit to S3 {statistics.median(commit_s):.2f} s (median of {len(commit_s)}); a new gang "
        f"{recovered_s:.1f} s after the cut"
    )
