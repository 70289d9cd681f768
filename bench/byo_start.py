"""A plain script's start through the real local stack, from `forgeline run` to its first
step: with a code folder's own environment built, reused, or not needed, and in a container
image (issue 46's benchmark; bench/byo.py times the environment alone, node-side).

    python -m bench.byo_start [--repeats 3]

Starts a private stack in a temporary FORGELINE_HOME (bench.local_stack.LocalStack: Temporal dev
server, MLflow, control worker, one node agent of one rank slot, on free ports), its data roots
at examples/data, podman on runc (tests/e2e/containers.conf) and uv's cache in an empty folder
of its own (UV_CACHE_DIR). Each subject is examples/byo/plain (the plain torchrun script, as
the spec examples/byo/plain.toml runs it, on 1 node, 60 steps, one save at the end), submitted
with `forgeline run SPEC --detach`, one run at a time:

    built      a copy of the folder whose requirements.txt asks for tomli-w==1.2.0 (small, pure
               Python, not on the node): the node agent builds its environment with uv before
               the ranks start, the uv cache emptied before each repeat; each repeat's file has
               a comment line of its own, so its sha256 (the environment's key) is new and
               every repeat builds a new environment (none is deleted from the node cache).
    reused     the same folder under another run name: the environment is in the node cache.
    none       the folder without requirements.txt: the node's own interpreter (the baseline).
    image      the same folder with `train.image` the test image (tests/e2e/images.py, built
               before anything is timed): it is local, so nothing is pulled; the agent checks
               it at its first start (`podman run` of its python3 importing torch, once per
               image id: infra.containers), the first repeat's, and every start is torchrun
               started cold in a container.

Measured: seconds from starting `forgeline run SPEC --detach` (the CLI itself, the code
snapshot's upload, admission, the grant, the node's fetch and environment, torchrun, the
script's imports) until rank 0's log (`nodes/*/runs/<run>/gen-*/rank-0.log`) holds the
script's first `step N loss` line, polled every 0.05 s. The script prints every 10 steps, so
that is its 10th step (milliseconds each for its small GRU, the same in every subject). Each
run is then followed to AWAITING_APPROVAL (`forgeline run SPEC`), and the node left a few
seconds, before the next. One untimed run of the baseline comes first, so that no subject pays
for the dataset snapshot, or for the stack's first run. Medians over the repeats; a footnote
says how long uv's build itself took (the environment's record) and which starts the node's
warm standby served (its agent's log): the baseline's, since each job leaves one behind
(trainer/launch.py); a run with an environment or an image starts cold by design (a standby
is the node's own interpreter, outside any image).
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.local_stack import LocalStack
from bench.recovery import REPO, wait_for
from bench.trainer import table
from infra.user_envs import built
from tests.e2e.images import ensure_test_image
from tests.e2e.test_user_code import BYO, byo_spec

PLAIN = BYO / "plain"
PACKAGE = "tomli-w==1.2.0"
STEPS = 60
# The script's own line (examples/byo/plain/train.py), printed by rank 0 every 10 steps.
STEP_LINE = re.compile(r"^step \d+ loss ", re.M)
# Between runs: the last run's folder commit and the agent's clean-up are done with the CPU.
SETTLE_S = 5.0
SUBJECTS = ("built", "reused", "none", "image")


@dataclass(frozen=True)
class Start:
    run: str
    seconds: float  # submission → first step line
    warm: bool  # the node's warm standby became its torchrun


def _code(root: Path, name: str, requirements: str | None) -> Path:
    """examples/byo/plain copied without its requirements.txt (`torch>=2.6`, which the node
    meets), with `requirements` as its file where given."""
    folder = Path(shutil.copytree(PLAIN, root / name,
                                  ignore=shutil.ignore_patterns("requirements.txt")))  # fmt: skip
    if requirements is not None:
        (folder / "requirements.txt").write_text(requirements)
    return folder


def _spec(root: Path, run: str, code: Path, image: str | None = None) -> Path:
    spec = byo_spec(root, run, code, "plain.toml", nodes=1)
    text = spec.read_text()
    # A short run: the start is what is measured; one save, at the end, for the final commit.
    argv = '"--steps", "600", "--save-every", "60"'
    assert argv in text, f"examples/byo/plain.toml no longer has {argv}"
    text = text.replace(argv, f'"--steps", "{STEPS}", "--save-every", "{STEPS}"')
    if image is not None:
        text = text.replace("[train]\n", f'[train]\nimage = "{image}"\n')
    spec.write_text(text)
    return spec


def _start(stack: LocalStack, spec: Path) -> Start:
    """Submit `spec`, time it to its first step, follow it to AWAITING_APPROVAL."""
    run = spec.stem
    pattern = f"nodes/*/runs/{run}/gen-*/rank-0.log"

    def first_step() -> float | None:
        for log in stack.home.glob(pattern):
            if STEP_LINE.search(log.read_text(errors="replace")):
                return time.time()
        return None

    submitted = time.time()
    stack.cli("run", str(spec), "--detach")
    try:
        stepped = wait_for(first_step, 600, f"{run}'s first step")
    except TimeoutError:
        raise RuntimeError(f"{run}: no step yet\n{stack.cli('status', run)}") from None
    stack.cli("run", str(spec))  # attaches; fails unless it reaches AWAITING_APPROVAL
    time.sleep(SETTLE_S)
    return Start(run, stepped - submitted, _on_standby(stack, run))


def _on_standby(stack: LocalStack, run: str) -> bool:
    """Whether the agent handed the run to its warm standby (trainer.warm_launch's log line)."""
    logs = "".join(p.read_text(errors="replace") for p in (stack.home / "logs").glob("*.log"))
    return re.search(rf"the job in \S*/runs/{re.escape(run)}/\S* starts on the warm", logs) \
        is not None  # fmt: skip


def _build_seconds(stack: LocalStack) -> list[float]:
    """uv's build of each environment the node cache holds, as its record says."""
    records = [built(p) for p in stack.home.glob("nodes/*/cache/envs/*") if p.is_dir()]
    return [r.build_s for r in records if r is not None]


def measure(root: Path, repeats: int) -> tuple[dict[str, list[Start]], list[float]]:
    root.mkdir(parents=True, exist_ok=True)
    image = ensure_test_image()  # built once per machine (about 30 s), before any timing
    uv_cache = root / "uv-cache"
    stack = LocalStack(root / "home", {
        "FORGELINE_DATA_ROOTS": str(REPO / "examples" / "data"),
        # podman as this kind of host needs it: runc, not crun (tests/e2e/containers.conf).
        "CONTAINERS_CONF": str(REPO / "tests" / "e2e" / "containers.conf"),
        # The node agents' uv (infra.user_envs) downloads into this folder, emptied below.
        "UV_CACHE_DIR": str(uv_cache),
    })  # fmt: skip
    specs = root / "specs"
    specs.mkdir()
    plain = _code(root, "plain", None)
    starts: dict[str, list[Start]] = {subject: [] for subject in SUBJECTS}
    stack.up(1)
    try:
        warm_up = _start(stack, _spec(specs, "warm-up", plain))
        print(f"warm-up (untimed): {warm_up.seconds:.1f} s to the first step", flush=True)
        for i in range(repeats):
            shutil.rmtree(uv_cache, ignore_errors=True)  # what the first node of a host pays
            own = _code(root, f"own-{i}", f"# bench.byo_start repeat {i}\n{PACKAGE}\n")
            runs = {
                "built": _spec(specs, f"built-{i}", own),
                "reused": _spec(specs, f"reused-{i}", own),
                "none": _spec(specs, f"none-{i}", plain),
                "image": _spec(specs, f"image-{i}", plain, image),
            }
            for subject, spec in runs.items():
                start = _start(stack, spec)
                starts[subject].append(start)
                print(f"{start.run}: {start.seconds:.2f} s to the first step"
                      f"{' (warm standby)' if start.warm else ''}", flush=True)  # fmt: skip
        return starts, _build_seconds(stack)
    finally:
        stack.cli("down")


def rows(starts: dict[str, list[Start]]) -> list[tuple[str, str, str, str]]:
    med = {s: statistics.median(x.seconds for x in found) for s, found in starts.items()}
    baseline = f"{med['none']:.1f} none needed"
    measures = {
        "built": "submit → first step, environment built, empty uv cache (s)",
        "reused": "submit → first step, environment reused (s)",
        "image": "submit → first step, in a container image (local) (s)",
    }
    return [(measure, f"{med[s]:.1f}", baseline, f"{med[s] - med['none']:+.1f} s")
            for s, measure in measures.items()]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="forgeline-bench-byo-start-") as tmp:
        starts, builds = measure(Path(tmp), args.repeats)
    print(table(rows(starts)))
    standby = ", ".join(f"{s} {sum(x.warm for x in found)}/{len(found)}"
                        for s, found in starts.items())  # fmt: skip
    print(f"\nmedians of {args.repeats}; uv's build itself (the environment's record): "
          f"{', '.join(f'{b:.2f}' for b in sorted(builds))} s; starts on the node's warm "
          f"standby: {standby}")  # fmt: skip


if __name__ == "__main__":
    main()
