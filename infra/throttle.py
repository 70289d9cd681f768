"""Make processes run `factor` times slower, the way a throttled GPU or a noisy neighbour would:
they are stopped (SIGSTOP) for part of every short period and continued (SIGCONT) for the rest.

Nothing in the throttled code changes or knows; it is simply slower. Used by
`forgeline chaos slow-node` (detached, until the processes exit) and by the straggler tests.

    python -m infra.throttle --factor 3 PID [PID ...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time

PERIOD_S = 0.005  # shorter than a forward pass, so every one of them is slowed alike


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]  # noqa: SIM115
    except OSError:
        return False
    return state != "Z"


def throttle(pids: list[int], factor: float, until: float = float("inf")) -> None:
    """Slow `pids` down by `factor` until they have all exited (or `until`, a monotonic time);
    they are always left running."""
    if factor <= 1:
        raise ValueError(f"factor must be above 1 (got {factor}): 2 means half speed")
    running_s = PERIOD_S / factor
    try:
        while time.monotonic() < until:
            pids = [pid for pid in pids if alive(pid)]
            if not pids:
                return
            _signal(pids, signal.SIGCONT)
            time.sleep(running_s)
            _signal(pids, signal.SIGSTOP)
            time.sleep(PERIOD_S - running_s)
    finally:
        _signal(pids, signal.SIGCONT)


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _exit(*_: object) -> None:
    raise SystemExit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--factor", type=float, required=True)
    parser.add_argument("--seconds", type=float, default=None, help="stop throttling after this")
    parser.add_argument("pids", type=int, nargs="+")
    args = parser.parse_args()
    until = time.monotonic() + args.seconds if args.seconds else float("inf")
    signal.signal(signal.SIGTERM, _exit)  # `finally` in throttle() leaves the pids running
    throttle(args.pids, args.factor, until)


if __name__ == "__main__":
    main()
