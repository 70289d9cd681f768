"""A hostile training script submitted through the API by an ordinary `submit:` user, on the
local stack whose agents box their ranks (bubblewrap): it tries every door issue 44 found open,
and the test checks that each attempt failed and that nothing it aimed at changed.

What it tries, from inside its rank: read the agent's environment through /proc and its own;
read the stack's state folder (tokens, the admin's token, the MLflow login, the env); list,
read and overwrite another team's checkpoint through the store it is given; write its fence;
plant a module in its code; print the store's secret to its log. And, from outside, its
submitter asks to start from that other team's checkpoint.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest

from forgeline import ApiError, Client
from tests.e2e.conftest import Stack
from tests.e2e.images import ensure_test_image
from tests.e2e.test_user_code import BYO, byo_spec

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

THEIRS = "runs/team-b-weights/checkpoints/step-10/gen-1"
REPORT = "HOSTILE-REPORT "
HOSTILE = textwrap.dedent(
    '''
    """Looks for everything it should not find, prints what it found, and never trains."""
    import json, os, pathlib

    probe = json.loads(pathlib.Path(__file__).with_name("probe.json").read_text())
    found = {"uid": os.getuid(), "processes": 0, "leaks_in_proc": [], "read": {}, "door": {}}
    status = pathlib.Path("/proc/self/status").read_text()
    found["capabilities"] = status.split("CapEff:")[1].split()[0]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            found["processes"] += 1
            try:
                if probe["secret"] in open(f"/proc/{entry}/environ").read():
                    found["leaks_in_proc"].append(entry)
            except OSError:
                pass
    found["leak_in_env"] = any(probe["secret"] in v for v in os.environ.values())
    found["store_env"] = sorted(n for n in os.environ if n.startswith(("AWS_", "FORGELINE_ST")))
    for path in probe["read"]:
        try:
            pathlib.Path(path).read_bytes()
            found["read"][path] = "read"
        except OSError as err:
            found["read"][path] = type(err).__name__
    try:
        pathlib.Path(__file__).with_name("tqdm.py").write_text("import os")
        found["planted"] = "yes"
    except OSError as err:
        found["planted"] = type(err).__name__
    from infra.store.factory import open_store
    job = json.loads(pathlib.Path(os.environ["FORGELINE_JOB"]).read_text())
    store = open_store(job["store_url"])
    found["store"] = store.url
    tries = {
        "list": lambda: store.list("runs/"),
        "read": lambda: store.get_bytes(probe["theirs"] + "/MANIFEST.json"),
        "overwrite": lambda: store.put_bytes(probe["theirs"] + "/MANIFEST.json", b"{}"),
        "fence": lambda: store.put_bytes(probe["fence"], b"{}"),
    }
    for name, attempt in tries.items():
        try:
            attempt()
            found["door"][name] = "done"
        except Exception as err:
            found["door"][name] = type(err).__name__
    print(f"AWS_SECRET_ACCESS_KEY={probe['secret']}")  # a secret printed to the log
    print("'''
    + REPORT
    + """" + json.dumps(found), flush=True)
    """
)


def node_states(stack: Stack) -> list[tuple[str, str, str, str | None]]:
    """Each node's health, its administrative state and why it is down: what a cordon or a
    quarantine would change."""
    state = json.loads(stack.cli("nodes", "--json").stdout)
    return sorted(
        (n["info"]["node_id"], n["health"], n["admin"], n.get("down_reason"))
        for n in state["nodes"]
    )


@pytest.mark.parametrize("in_an_image", [False, True], ids=["bubblewrap", "podman"])
def test_a_hostile_script_gets_nothing(stack: Stack, tmp_path: Path, in_an_image: bool) -> None:
    """In a bubblewrap box, or in a container of its own image (train.image): the same doors
    stay closed. A container's ranks are uid 0 inside, with no capability at all."""
    run = "hostile-image" if in_an_image else "hostile"
    store = stack.store()
    manifest, weights = b'{"team": "b"}', b"team b's weights" * 64
    store.put_bytes(f"{THEIRS}/MANIFEST.json", manifest)
    store.put_bytes(f"{THEIRS}/model.safetensors", weights)
    secret = stack.env["AWS_SECRET_ACCESS_KEY"]  # what every agent of the stack holds
    nodes_before = node_states(stack)

    code = tmp_path / "hostile"
    shutil.copytree(BYO / "gru", code)
    (code / "train.py").write_text(HOSTILE)
    if in_an_image:
        (code / "requirements.txt").unlink()  # an image brings its own packages
    home = stack.home
    probe = {
        "secret": secret,
        "theirs": THEIRS,
        "fence": f"runs/{run}/generations/gen-9.json",
        "read": [str(home / "tokens.json"), str(home / "token"), str(home / "stack.json"),
                 str(home / "mlflow-login.json"), str(home / "mlflow-auth.ini")],
    }  # fmt: skip
    (code / "probe.json").write_text(json.dumps(probe))
    spec = byo_spec(tmp_path, run, code)
    text = spec.read_text().replace("[resources]\n", '[resources]\nteam = "research"\n')
    if in_an_image:
        text = text.replace("[train]\n", f'[train]\nimage = "{ensure_test_image()}"\n')
    spec.write_text(text)

    mallory = ("mallory", "submit:research")
    failed = stack.cli("run", str(spec), check=False, timeout=300, as_person=mallory)
    assert failed.returncode == 1 and "returned without training" in failed.stdout, failed.stdout
    logs = stack.cli("logs", run).stdout
    reports = [json.loads(line.split(REPORT, 1)[1]) for line in logs.splitlines() if REPORT in line]
    assert reports, logs[-3000:]
    for found in reports:  # every rank of the gang, each in its own box
        assert found["uid"] == (0 if in_an_image else 61000) and found["processes"] <= 8, found
        assert int(found["capabilities"], 16) == 0, found
        assert found["leaks_in_proc"] == [] and not found["leak_in_env"], found
        assert found["store_env"] == [] and found["store"].startswith("door://"), found
        assert set(found["read"].values()) == {"FileNotFoundError"}, found["read"]
        assert found["planted"] == "OSError", found
        assert set(found["door"].values()) == {"DoorRefused"}, found["door"]
    assert secret not in logs  # printed, but not stored as it was printed

    # Another team's weights, asked for by name: refused before any run starts.
    client = Client(stack.settings.api_url, stack.token(*mallory))
    taking = tmp_path / "taking.toml"
    taking.write_text(
        spec.read_text().replace(f'name = "{run}"', f'name = "taking-{run}"')
        + f'\n[model]\ninit_from = "{THEIRS}/MANIFEST.json"\n'
    )
    with pytest.raises(ApiError) as refused:
        client.submit(taking)
    assert refused.value.status == 403 and refused.value.field == "model.init_from", refused.value

    # Nothing it aimed at changed.
    assert store.get_bytes(f"{THEIRS}/MANIFEST.json") == manifest
    assert store.get_bytes(f"{THEIRS}/model.safetensors") == weights
    assert not store.exists(f"runs/{run}/generations/gen-9.json")
    assert node_states(stack) == nodes_before
