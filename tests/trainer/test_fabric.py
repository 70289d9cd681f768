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


def test_torchrun_is_told_who_serves_the_rendezvous_off_loopback(tmp_path: Path) -> None:
    rdzv = Rendezvous("198.18.4.11:29401", "run-g3", 2, 1, is_host=True)
    argv = torchrun_argv(tmp_path / "job.json", rdzv, Fabric("198.18.4.11", "eth2"))
    assert argv[argv.index("--rdzv-conf") + 1] == "is_host=true,read_timeout=600"
    assert argv[argv.index("--local-addr") + 1] == "198.18.4.11"
    peer = Rendezvous("198.18.4.11:29401", "run-g3", 2, 1, is_host=False)
    argv = torchrun_argv(tmp_path / "job.json", peer, Fabric("198.18.4.12", "eth2"))
    assert argv[argv.index("--rdzv-conf") + 1].startswith("is_host=false")
    # On loopback every node is "the host": whoever binds first serves, as before.
    local = torchrun_argv(tmp_path / "job.json", rdzv)
    assert "--rdzv-conf" not in local and "--local-addr" not in local
