"""A TCP port relayed to a unix socket, for as long as a child process runs.

    python -m infra.socket_relay --host H --port P --socket PATH -- COMMAND...

Starts COMMAND (which listens on the unix socket PATH, relative to this process's folder or
absolute), accepts connections on H:P and carries each one's bytes to and from the socket, both
ways, unread. Exits with COMMAND's status when it exits. This is how a process with no network
(a box made with --unshare-net) serves a port: a unix socket on a shared folder crosses network
namespaces, a TCP port does not. A connection made before the socket is there is closed at
once, as a port nobody listens on would be.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys

CHUNK = 1 << 16


async def relay(host: str, port: int, socket: str, command: list[str]) -> int:
    async def carry(client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        try:
            socket_in, socket_out = await asyncio.open_unix_connection(socket)
        except OSError:  # not listening yet (still starting) or gone
            client_out.close()
            return
        try:
            await asyncio.gather(_pipe(client_in, socket_out), _pipe(socket_in, client_out))
        finally:
            client_out.close()
            socket_out.close()

    server = await asyncio.start_server(carry, host, port, reuse_address=True)
    child = await asyncio.create_subprocess_exec(*command)
    try:
        return await child.wait()
    finally:
        server.close()


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    """Copy until `source` ends, then end `sink`'s writing half (the other way may go on)."""
    try:
        while data := await source.read(CHUNK):
            sink.write(data)
            await sink.drain()
        if sink.can_write_eof():
            sink.write_eof()
    except (ConnectionError, OSError):
        sink.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.socket_relay")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--socket", required=True, help="the unix socket COMMAND listens on")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no COMMAND after --")
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(relay(args.host, args.port, args.socket, command))
    return 130


if __name__ == "__main__":
    sys.exit(main())
