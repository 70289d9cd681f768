"""The address a host advertises and the interface its ranks bind, on this machine's own
interfaces (the multi-host tests check them inside network namespaces)."""

from __future__ import annotations

import pytest

from infra.host_network import HostNetworkError, address_towards, interface_of, is_loopback


def test_the_address_towards_loopback_is_loopback_on_lo() -> None:
    address = address_towards("127.0.0.1", 7233)
    assert address == "127.0.0.1"
    assert interface_of(address) == "lo"
    assert is_loopback(address) and is_loopback("localhost") and not is_loopback("198.18.0.1")


def test_an_address_no_interface_holds_is_refused_with_the_fix() -> None:
    with pytest.raises(HostNetworkError, match=r"no interface of this host holds 203\.0\.113\.9"):
        interface_of("203.0.113.9")
    with pytest.raises(HostNetworkError, match="not an IPv4 address"):
        interface_of("node-1.example")


def test_a_host_with_no_route_is_named() -> None:
    with pytest.raises(HostNetworkError, match=r"no route from this host to nowhere\.invalid"):
        address_towards("nowhere.invalid", 7233)
