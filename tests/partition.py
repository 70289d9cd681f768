"""A TCP forwarder between clients and a server: killing it partitions them, restarting heals.

Run as its own process (`python -m tests.partition LISTEN_PORT TARGET_PORT`) so that the test
process's GIL never slows the traffic; `Partition` starts, cuts and heals it. Cutting closes the
listener and every open connection at once, as a site that drops off the network would look to
its clients: new connections are refused, open ones reset.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

from infra.processes import free_port, port_is_open


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def _forward(listen: int, target: int) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            target_reader, target_writer = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, target_writer), _pipe(target_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", listen, reuse_address=True)
    async with server:
        await server.serve_forever()


class Partition:
    """Clients use `port`; while cut, nothing there answers."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._process: subprocess.Popen | None = None

    def heal(self) -> None:
        if self._process is not None:
            return
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.partition", str(self.port), str(self.target_port)],
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while not port_is_open("127.0.0.1", self.port):
            if time.monotonic() > deadline or self._process.poll() is not None:
                raise RuntimeError(f"the forwarder to port {self.target_port} did not start")
            time.sleep(0.05)

    def cut(self) -> None:
        if self._process is None:
            return
        self._process.send_signal(signal.SIGKILL)
        self._process.wait()
        self._process = None


if __name__ == "__main__":
    asyncio.run(_forward(int(sys.argv[1]), int(sys.argv[2])))
