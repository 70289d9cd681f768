"""A run in a container image of its own (`train.image`): the plain torchrun script of
examples/byo/plain runs in an image built from this machine's files (tests/e2e/images.py), on
the image's Python and torch, survives a SIGKILLed node agent (its container ends with it),
resumes from the folder Forgeline committed and is registered."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import Stack, alive, ranks_of, wait_for
from tests.e2e.faults import survives_a_dead_agent
from tests.e2e.images import MARKER, ensure_test_image
from tests.e2e.test_user_code import BYO, byo_spec
from trainer.manifest import find_latest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# The image's torch, as a rank's memory maps name it (inside its own mount namespace).
IMAGE_TORCH = "/usr/local/lib/python3.11/dist-packages/torch/lib/libtorch_cpu.so"


def containers_of(node_label: str = "") -> list[str]:
    """Forgeline's containers on this machine (every node's, or one node's)."""
    label = f"label=forgeline.node{'=' + node_label if node_label else ''}"
    listed = subprocess.run(["podman", "ps", "--all", "--quiet", "--filter", label],
                            capture_output=True, text=True, check=True)  # fmt: skip
    return listed.stdout.split()


def _maps(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return ""


def test_a_script_runs_in_its_image_survives_a_dead_agent_and_is_registered(
    stack: Stack, tmp_path: Path
) -> None:
    image = ensure_test_image()
    spec = byo_spec(tmp_path, "byo-image", BYO / "plain", "plain.toml", heartbeat_timeout_s=5)
    # Saves far enough apart for the folder to be quiet between them (a commit waits for that):
    # in the image, nothing else slowing it, the script runs 600 steps in seconds.
    text = spec.read_text().replace('"--steps", "600", "--save-every", "60"',
                                    '"--steps", "1500", "--save-every", "250"')  # fmt: skip
    spec.write_text(text.replace("[train]\n", f'[train]\nimage = "{image}"\n'))
    # The example declares its packages (requirements.txt), which an image run would not get.
    refused = stack.cli("run", str(spec), "--detach", check=False)
    assert refused.returncode != 0 and "the image's packages are the ones" in refused.stdout + (
        refused.stderr
    )
    code = shutil.copytree(BYO / "plain", tmp_path / "plain",
                           ignore=shutil.ignore_patterns("requirements.txt"))  # fmt: skip
    spec.write_text(spec.read_text().replace(f'code = "{BYO / "plain"}"', f'code = "{code}"'))
    assert "submitted run byo-image" in stack.cli("run", str(spec), "--detach").stdout

    # Its ranks run the image's Python and torch, in the image's root.
    def in_the_image() -> list[int]:  # (podman's own process names the command too)
        return [p for p in ranks_of(stack.home, "byo-image")
                if alive(p) and Path(f"/proc/{p}/root", MARKER).exists()]  # fmt: skip

    def maps_with_torch() -> list[str]:
        maps = [_maps(p) for p in in_the_image()]
        return [m for m in maps if "libtorch_cpu.so" in m]

    maps = wait_for(maps_with_torch, 180, "ranks in the image with torch loaded")
    assert all(IMAGE_TORCH in m for m in maps), "a rank loaded another torch"
    assert not any("site-packages/torch/lib" in m for m in maps), "the node's torch is loaded"
    assert len(containers_of()) == 2  # one per node of the gang

    killed, _status = survives_a_dead_agent(stack, "byo-image", spec, seed=47)
    final = find_latest(stack.store(), "byo-image", max_generation=10**9)
    assert final is not None and final.generation > killed
    last = f"*/runs/byo-image/gen-{final.generation}/rank-0.log"
    logs = [p.read_text() for p in (stack.home / "nodes").glob(last)]
    assert any("resumed at step" in log for log in logs), logs
    # Nothing of either gang is left: podman removed every container when it ended, the
    # killed agent's too (its lifeline closed).
    wait_for(lambda: not containers_of(), 30, "no container left")
