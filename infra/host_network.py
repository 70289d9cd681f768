"""Which address a host advertises to its peers, and which network interface carries it.

A node agent tells the cluster the address other nodes reach it at; its ranks must then bind
the interface that holds that address (gloo and NCCL pick an interface of their own otherwise,
often the first non-loopback one, which on a real host may be a management network the peers
cannot reach, and in a network namespace may not exist at all).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

from infra.errors import InfraError

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


class HostNetworkError(InfraError):
    """The host has no address or interface for what was asked; the message says what to set."""


def address_towards(host: str, port: int) -> str:
    """The local address this host's packets to `host:port` leave from: what peers on the same
    network reach it at. A UDP `connect` only asks the kernel's routing table; nothing is sent."""
    try:
        family, _, _, _, target = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(target)
            return str(probe.getsockname()[0])
    except OSError as err:
        raise HostNetworkError(
            f"no route from this host to {host}:{port} ({err.strerror or err}): "
            "check the address, or give the agent --advertise-address"
        ) from None


def interface_of(address: str) -> str:
    """The name of the interface that holds `address` (IPv4), e.g. `eth0`, `ib0`, `lo`."""
    try:
        wanted = ipaddress.IPv4Address(address)
    except ValueError:
        raise HostNetworkError(
            f"{address!r} is not an IPv4 address: advertise one of this host's IPv4 addresses"
        ) from None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name.encode())
                packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:  # an interface with no IPv4 address
                continue
            if ipaddress.IPv4Address(packed[20:24]) == wanted:
                return name
    raise HostNetworkError(
        f"no interface of this host holds {address}: advertise one of its own addresses "
        "(`ip -4 addr` lists them)"
    )


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"
