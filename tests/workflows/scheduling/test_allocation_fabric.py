"""What a grant tells its nodes about the fabric: a rendezvous port of its own, and the peak
its devices' MFU is measured against."""

from __future__ import annotations

from workflows.contracts.cluster_models import Allocation, NodeInfo


def _node(name: str, **fields: object) -> NodeInfo:
    return NodeInfo(node_id=name, host=f"198.18.0.{len(name)}", rdzv_port=29400,
                    incarnation=name, **fields)  # fmt: skip


def test_each_grant_rendezvouses_on_the_next_port_of_the_head() -> None:
    head = _node("h1", rdzv_ports=4)
    endpoints = [
        Allocation(run_id="r", generation=g, nodes=[head, _node("h22")]).rdzv_endpoint
        for g in range(1, 7)
    ]
    ports = [int(e.rsplit(":", 1)[1]) for e in endpoints]
    assert ports == [29401, 29402, 29403, 29400, 29401, 29402]
    assert all(e.startswith(f"{head.host}:") for e in endpoints)


def test_an_agent_of_before_port_ranges_keeps_its_one_port() -> None:
    # NodeInfo as older agents registered it (and recorded histories hold it): no rdzv_ports.
    old = NodeInfo.model_validate(
        {"node_id": "n", "host": "127.0.0.1", "rdzv_port": 40000, "incarnation": "x"}
    )
    assert Allocation(run_id="r", generation=9, nodes=[old]).rdzv_endpoint == "127.0.0.1:40000"


def test_mfu_is_measured_against_the_gangs_reported_peak() -> None:
    gpus = [_node("a", gpu_type="h100", peak_flops=989e12), _node("b", gpu_type="h100",
            peak_flops=989e12)]  # fmt: skip
    assert Allocation(run_id="r", generation=1, nodes=gpus).device_peak_flops(8) == 989e12
    cpus = [_node("c", gpu_type="cpu", peak_flops=2e10), _node("d", gpu_type="cpu",
            peak_flops=4e10)]  # fmt: skip
    # A CPU slot's peak is one thread's: a rank with 2 threads can do twice as much.
    assert Allocation(run_id="r", generation=1, nodes=cpus).device_peak_flops(2) == 6e10
    unknown = [_node("e")]
    assert Allocation(run_id="r", generation=1, nodes=unknown).device_peak_flops() is None
