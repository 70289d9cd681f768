"""A checkpoint commit through the local store is durable before it counts (issue 17, item 5).

A real commit runs in a child process under strace, which records the system calls that decide
what a power cut keeps: fsync, rename, link, mkdir, unlink. The order in that log is the order
the kernel saw, so the test checks durability itself rather than the code that should cause it:
every object's data is on the disk before its name appears, every name (and every new folder)
before the manifest that lists it, and the manifest's name before anything older is deleted.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from infra.store.local import LocalStore
from tests.conftest import REPO

STRACE = shutil.which("strace")
TRACED = "fsync,fdatasync,rename,renameat,renameat2,link,linkat,mkdir,mkdirat,unlink,unlinkat"
NEW, OLD = "runs/r/checkpoints/step-20/gen-1", "runs/r/checkpoints/step-10/gen-1"

# What a checkpoint commit does through the store: shards, the manifest last and
# create-if-absent, then the older checkpoint pruned (manifest first, then its files).
STORE_COMMIT = f"""
import sys
from pathlib import Path
from infra.store.local import LocalStore
store, shards = LocalStore(Path(sys.argv[1])), Path(sys.argv[2])
for shard in sorted(shards.iterdir()):
    store.put_file("{NEW}/" + shard.name, shard)
assert store.put_if_absent("{NEW}/MANIFEST.json", b"{{}}")
for key in store.list("{OLD}/"):
    store.delete(key)
"""

# The same through the real Checkpointer: DCP shards of a tiny model, step 10 then step 20,
# keep=1, so the commit of step 20 prunes step 10 (trainer.checkpoint, trainer.manifest.prune).
CHECKPOINTER_COMMIT = """
import sys
from pathlib import Path
import torch
import torch.distributed as dist
from infra.store.local import LocalStore
from trainer.checkpoint import Checkpointer
store, work = LocalStore(Path(sys.argv[1])), Path(sys.argv[2])
work.mkdir(parents=True)  # the file rendezvous waits forever for a folder that is not there
dist.init_process_group("gloo", init_method=f"file://{work / 'rdzv'}", rank=0, world_size=1)
saver = Checkpointer(store=store, staging_dir=work / "staging", run_id="r", generation=1,
                     keep=1, layout={}, asynchronous=False)
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in (10, 20):
    saver.save(model, optimizer, step, {"tokens_seen": step})
    saver.wait()
saver.close()
dist.destroy_process_group()
"""

_CALL = re.compile(r"^(?P<pid>\d+)\s+(?P<name>\w+)\((?P<args>.*)\)\s+=\s+(?P<ret>-?\d+)")
_UNFINISHED = re.compile(r"^(?P<pid>\d+)\s+(?P<head>.*) <unfinished \.\.\.>$")
_RESUMED = re.compile(r"^(?P<pid>\d+)\s+<\.\.\. \w+ resumed>(?P<tail>.*)$")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_FD_PATH = re.compile(r"^\d+<(.*)>$")


@dataclass(frozen=True)
class Call:
    """One successful traced call: its name and the paths it acted on (source, then target)."""

    name: str
    paths: tuple[Path, ...]


def traced_calls(log: Path) -> list[Call]:
    """The successful calls of an `strace -f -y` log, in the order they completed."""
    calls, pending = [], {}
    for line in log.read_text().splitlines():
        if m := _UNFINISHED.match(line):  # another thread's call interleaved: joined below
            pending[m["pid"]] = m["head"]
            continue
        if (m := _RESUMED.match(line)) and m["pid"] in pending:
            line = f"{m['pid']} {pending.pop(m['pid'])}{m['tail']}"
        m = _CALL.match(line)
        if m is None or m["ret"] != "0":
            continue
        if m["name"] in ("fsync", "fdatasync"):
            fd = _FD_PATH.match(m["args"])
            paths = (Path(fd[1]),) if fd else ()
        else:
            paths = tuple(Path(p) for p in _QUOTED.findall(m["args"]))
        calls.append(Call(m["name"].removesuffix("at").removesuffix("at2"), paths))
    return calls


def is_scratch(path: Path) -> bool:
    """The store's temporary file of a write in flight, not an object."""
    return path.name.startswith(".tmp-")


def durability_problems(calls: list[Call], root: Path, manifest: Path, older: Path) -> list[str]:
    """Each way the log lets a crash lose or tear the commit of `manifest`, in words."""

    def synced(path: Path, after: int, before: int) -> bool:
        """Whether `path` was fsynced strictly between the calls `after` and `before`."""
        window = calls[after + 1 : before]
        return any(c.name in ("fsync", "fdatasync") and c.paths == (path,) for c in window)

    (commit,) = [i for i, c in enumerate(calls) if c.name == "link" and c.paths[1:] == (manifest,)]
    deletes = [
        i
        for i, c in enumerate(calls)
        if c.name == "unlink" and older in c.paths[0].parents and not is_scratch(c.paths[0])
    ]
    assert deletes, f"nothing of {older} was deleted"
    problems = []
    for i, call in enumerate(calls):
        target = call.paths[-1] if call.paths else root
        if root not in target.parents:
            continue
        if call.name in ("rename", "link"):
            assert is_scratch(call.paths[0]), call
            if not synced(call.paths[0], -1, i):
                problems.append(f"{target.name} named by {call.name} before its data was fsynced")
        named = call.name in ("rename", "mkdir") and target.parent in manifest.parents
        if named and i < commit and not synced(target.parent, i, commit):
            problems.append(f"{target.name}'s name in its folder not fsynced before the manifest")
    if not synced(manifest.parent, commit, deletes[0]):
        problems.append("the manifest's folder was not fsynced between its link and the deletes")
    return problems


def strace(script: str, *args: Path, log: Path) -> list[Call]:
    if STRACE is None:
        pytest.skip("strace is missing: apt-get install strace (CI's .ci/run installs it)")
    command = [STRACE, "-f", "-y", "-qq", "-e", f"trace={TRACED}", "-o", str(log)]
    subprocess.run(
        [*command, sys.executable, "-c", script, *map(str, args)], cwd=REPO, check=True, timeout=120
    )
    return traced_calls(log)


def test_a_store_commit_is_durable_before_the_older_checkpoint_goes(tmp_path: Path) -> None:
    """Before: no fsync at all; every rename and the manifest's link went unsynced, and the
    older checkpoint was deleted while the new one could still vanish in a power cut."""
    store = LocalStore(tmp_path / "store")
    for name in ("MANIFEST.json", "__0_0.distcp"):
        store.put_bytes(f"{OLD}/{name}", b"older")
    shards = tmp_path / "shards"
    shards.mkdir()
    for rank in range(3):
        (shards / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 4096)

    calls = strace(STORE_COMMIT, store.root, shards, log=tmp_path / "strace.log")
    manifest = store.root / NEW / "MANIFEST.json"
    problems = durability_problems(calls, store.root, manifest, store.root / OLD)
    assert not problems, "\n".join(problems)
    assert json.loads(manifest.read_bytes()) == {} and store.list(f"{OLD}/") == []


def test_a_checkpointer_commit_is_durable_before_it_prunes_the_one_before(tmp_path: Path) -> None:
    """The same, end to end through Checkpointer's upload, manifest and prune."""
    store = LocalStore(tmp_path / "store")
    calls = strace(CHECKPOINTER_COMMIT, store.root, tmp_path / "work", log=tmp_path / "trace")
    manifest = store.root / NEW / "MANIFEST.json"
    problems = durability_problems(calls, store.root, manifest, store.root / OLD)
    assert not problems, "\n".join(problems)
    assert manifest.is_file() and store.list(f"{OLD}/") == []
