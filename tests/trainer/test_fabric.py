"""How a node's ranks are pointed at their fabric: the advertised interface for gloo and NCCL
unless the operator chose, every NCCL setting of the agent passed on, and torchrun told who
serves the rendezvous when it cannot tell from loopback."""

from __future__ import annotations

from pathlib import Path

from trainer.launch import LOOPBACK, Fabric, Rendezvous, torchrun_argv


def test_the_ranks_bind_the_advertised_interface_unless_the_operator_chose() -> None:
    fabric = Fabric("198.18.4.11", "eth2")
    assert fabric.environment({}) == {"GLOO_SOCKET_IFNAME": "eth2", "NCCL_SOCKET_IFNAME": "eth2"}
    chosen = fabric.environment({"NCCL_SOCKET_IFNAME": "ib0", "NCCL_IB_HCA": "mlx5_0"})
    assert chosen == {"GLOO_SOCKET_IFNAME": "eth2", "NCCL_SOCKET_IFNAME": "ib0"}
    assert LOOPBACK.environment({}) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def test_torchrun_is_told_its_node_s_place_and_where_peers_reach_it(tmp_path: Path) -> None:
    head = Rendezvous("198.18.4.11:29401", "run-g3", 2, 1, node_rank=0)
    argv = torchrun_argv(tmp_path / "job.json", head, Fabric("198.18.4.11", "eth2"))
    assert argv[argv.index("--rdzv-backend") + 1] == "static"
    assert argv[argv.index("--node-rank") + 1] == "0"  # the head: it serves the store
    assert argv[argv.index("--local-addr") + 1] == "198.18.4.11"
    peer = Rendezvous("198.18.4.11:29401", "run-g3", 2, 1, node_rank=1)
    argv = torchrun_argv(tmp_path / "job.json", peer, Fabric("198.18.4.12", "eth2"))
    assert argv[argv.index("--node-rank") + 1] == "1"
    assert argv[argv.index("--rdzv-endpoint") + 1] == "198.18.4.11:29401"
    assert argv[argv.index("--local-addr") + 1] == "198.18.4.12"
    # On loopback the peers reach every node at 127.0.0.1: nothing to advertise.
    assert "--local-addr" not in torchrun_argv(tmp_path / "job.json", head)
