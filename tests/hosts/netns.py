"""Hosts made of Linux network namespaces: each has its own address on a bridge in the root
namespace, where the servers listen on the bridge's address.

Addresses come from 198.18.0.0/15 (RFC 2544's benchmarking range, never routed on the
internet), one /24 per network picked at random so two test runs on one machine do not meet;
traffic goes only to these addresses and to loopback. Everything made is deleted on exit, also
when the test fails.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from dataclasses import dataclass, field


class NamespacesUnavailable(Exception):
    """This machine cannot make network namespaces (not root, or no `ip`)."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@dataclass
class Host:
    name: str
    namespace: str
    address: str
    link: str  # the veth end on the bridge (root namespace): down is a cut cable

    def argv(self, *command: str) -> list[str]:
        """`command` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *command]

    def cut(self) -> None:
        _ip("link", "set", self.link, "down")

    def mend(self) -> None:
        _ip("link", "set", self.link, "up")


@dataclass
class Network:
    hosts: list[Host] = field(default_factory=list)
    bridge: str = ""
    gateway: str = ""  # the bridge's address: where the root namespace's servers listen

    @classmethod
    def check_possible(cls) -> None:
        if os.geteuid() != 0:
            raise NamespacesUnavailable("network namespaces need root (ip netns add)")
        if shutil.which("ip") is None:
            raise NamespacesUnavailable("the `ip` command (iproute2) is not installed")

    def build(self, count: int) -> Network:
        self.check_possible()
        tag = f"{random.randrange(16**4):04x}"
        subnet = f"198.{18 + random.randrange(2)}.{random.randrange(1, 255)}"
        self.bridge, self.gateway = f"flb{tag}", f"{subnet}.1"
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for index in range(1, count + 1):
            host = Host(f"h{index}", f"fl{tag}-h{index}", f"{subnet}.{10 + index}",
                        f"flv{tag}h{index}")  # fmt: skip
            self.hosts.append(host)  # before it exists: teardown deletes what was made of it
            inside = f"flp{tag}h{index}"
            _ip("netns", "add", host.namespace)
            _ip("link", "add", host.link, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", host.namespace)
            _ip("link", "set", host.link, "master", self.bridge, "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", inside)
            _ip("-n", host.namespace, "link", "set", inside, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        return self

    def teardown(self) -> None:
        # Deleting a namespace deletes its veth end, and with it the pair's end on the bridge.
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
            subprocess.run(["ip", "link", "del", host.link], capture_output=True)
        if self.bridge:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
