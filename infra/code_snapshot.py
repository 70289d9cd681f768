"""A user's code folder as a content-addressed snapshot in the object store, like a dataset.

The submitter's machine uploads the folder once (`publish`); every node fetches it into its
cache and checks every file against the manifest before anything runs (`fetch`). The snapshot's
id is the sha256 of its sorted file list (path, size, sha256), so the same code is the same
snapshot wherever and however often it is submitted, and a node can recompute the id from what
it holds: a file changed in the store or in the cache is refused, never run.

    code/<id>/files/<sha256>     one object per distinct file content
    code/<id>/MANIFEST.json      written last, create-if-absent: no manifest, no snapshot

What goes in: every file under the folder except what its `.gitignore` files exclude (the same
patterns git applies, nested files included; on the machine that packs the folder, not again
where an upload is published), `.git/`, `__pycache__/` and compiled Python.
A file over `MAX_FILE_BYTES`, a folder over `MAX_FILES` or `MAX_TOTAL_BYTES`, and a link that
leaves the folder are refused by name: data belongs in the dataset, not the code.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pathspec

from infra.digest import sha256_file
from infra.errors import IntegrityError
from infra.store.protocol import ObjectStore, fetch_verified

MANIFEST_FORMAT = 1
MAX_FILE_BYTES = 10 * 2**20
MAX_TOTAL_BYTES = 100 * 2**20
MAX_FILES = 5000
# Never code: the repository's own database, caches and byte code of any interpreter.
ALWAYS_LEFT_OUT = pathspec.GitIgnoreSpec.from_lines(
    [".git/", "__pycache__/", "*.pyc", "*.pyo", ".ipynb_checkpoints/"]
)


class CodeSnapshotError(ValueError):
    """The code folder cannot become a snapshot; the message names the file and the fix."""


@dataclass(frozen=True)
class CodeFile:
    path: str  # relative, POSIX separators
    bytes: int
    sha256: str


@dataclass(frozen=True)
class PublishedCode:
    snapshot_id: str
    manifest_key: str
    manifest_sha256: str
    files: int
    bytes: int
    reused: bool  # the store already held this snapshot


def _ignore_rules(
    folder: Path, rel_dir: PurePosixPath
) -> list[tuple[PurePosixPath, pathspec.GitIgnoreSpec]]:
    ignore_file = folder / rel_dir / ".gitignore"
    if not ignore_file.is_file():
        return []
    lines = ignore_file.read_text(errors="replace").splitlines()
    return [(rel_dir, pathspec.GitIgnoreSpec.from_lines(lines))]


def _ignored(
    rel: PurePosixPath, is_dir: bool, rules: list[tuple[PurePosixPath, pathspec.GitIgnoreSpec]]
) -> bool:
    name = rel.as_posix() + ("/" if is_dir else "")
    if ALWAYS_LEFT_OUT.match_file(name):
        return True
    # A nested .gitignore speaks of paths below its own folder, as git reads it.
    for base, spec in rules:
        inner = rel.relative_to(base).as_posix() + ("/" if is_dir else "")
        if spec.match_file(inner):
            return True
    return False


def collect(folder: Path, gitignore: bool = True) -> list[CodeFile]:
    """The files of the snapshot, sorted by path, each with its size and sha256; without
    `gitignore`, the folder's .gitignore files are files like any other and exclude nothing
    (a folder unpacked from `pack`, whose files they already chose)."""
    folder = folder.resolve()
    if not folder.is_dir():
        raise CodeSnapshotError(f"train.code {str(folder)!r} is not a folder")
    files: list[CodeFile] = []
    total = 0

    def walk(rel_dir: PurePosixPath, rules: list) -> None:
        nonlocal total
        if gitignore:
            rules = rules + _ignore_rules(folder, rel_dir)
        for entry in sorted(os.scandir(folder / rel_dir), key=lambda e: e.name):
            rel = rel_dir / entry.name
            path = Path(entry.path)
            if _ignored(rel, entry.is_dir(), rules):
                continue
            if entry.is_symlink() and folder not in path.resolve().parents:
                raise CodeSnapshotError(
                    f"{rel}: a link to {path.resolve()}, outside the code folder; copy what "
                    "it points to into the folder or list it in .gitignore"
                )
            if path.is_dir():
                walk(rel, rules)
                continue
            size = path.stat().st_size
            if size > MAX_FILE_BYTES:
                raise CodeSnapshotError(
                    f"{rel}: {size / 2**20:.1f} MiB is more than a code file may hold "
                    f"({MAX_FILE_BYTES // 2**20} MiB): put data in [data] or list the file in "
                    ".gitignore"
                )
            total += size
            files.append(CodeFile(rel.as_posix(), size, sha256_file(path)))
            if len(files) > MAX_FILES or total > MAX_TOTAL_BYTES:
                raise CodeSnapshotError(
                    f"{folder} holds more than {MAX_FILES} files or "
                    f"{MAX_TOTAL_BYTES // 2**20} MiB of code (at {rel}): point train.code at "
                    "the folder of the training code only, or list the rest in .gitignore"
                )

    walk(PurePosixPath(), [])
    if not files:
        raise CodeSnapshotError(f"train.code {str(folder)!r} holds no files to run")
    return files


def snapshot_id(files: list[CodeFile]) -> str:
    """The content address: sha256 of the sorted (path, size, sha256) lines."""
    lines = "".join(
        f"{f.path}\0{f.bytes}\0{f.sha256}\n" for f in sorted(files, key=lambda f: f.path)
    )
    return hashlib.sha256(lines.encode()).hexdigest()[:32]


def manifest_key(snapshot: str) -> str:
    return f"code/{snapshot}/MANIFEST.json"


def _blob_key(snapshot: str, sha256: str) -> str:
    return f"code/{snapshot}/files/{sha256}"


def _manifest_bytes(snapshot: str, files: list[CodeFile]) -> bytes:
    body = {
        "format": MANIFEST_FORMAT,
        "snapshot": snapshot,
        "files": [{"path": f.path, "bytes": f.bytes, "sha256": f.sha256} for f in files],
    }
    return json.dumps(body, indent=1, sort_keys=True).encode()


def publish(store: ObjectStore, folder: Path, gitignore: bool = True) -> PublishedCode:
    """Upload the folder's snapshot unless the store holds it; files first, manifest last
    (`gitignore`: as `collect`)."""
    files = collect(folder, gitignore)
    snapshot = snapshot_id(files)
    manifest = _manifest_bytes(snapshot, files)
    digest = hashlib.sha256(manifest).hexdigest()
    published = PublishedCode(
        snapshot_id=snapshot,
        manifest_key=manifest_key(snapshot),
        manifest_sha256=digest,
        files=len(files),
        bytes=sum(f.bytes for f in files),
        reused=True,
    )
    if store.exists(manifest_key(snapshot)):
        return published
    root = folder.resolve()
    for entry in {f.sha256: f for f in files}.values():
        store.put_file(_blob_key(snapshot, entry.sha256), root / entry.path)
    store.put_if_absent(manifest_key(snapshot), manifest)  # an identical one may have won
    return PublishedCode(**{**published.__dict__, "reused": False})


def pack(folder: Path) -> tuple[bytes, str]:
    """The snapshot's files as an uncompressed tar (for the HTTP API, which publishes it from
    its side) and the snapshot id they make: the API's answer must name the same id."""
    files = collect(folder)
    root = folder.resolve()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in files:
            # Contents, not links: a link inside the folder is its target's bytes, as in
            # `collect`; and one mode, so the same code packs to the same tar anywhere.
            info = tarfile.TarInfo(entry.path)
            info.size, info.mode = entry.bytes, 0o644
            with open(root / entry.path, "rb") as f:
                tar.addfile(info, f)
    return buffer.getvalue(), snapshot_id(files)


def unpack(data: bytes, dest: Path) -> None:
    """A tar from `pack` as files under `dest`: regular files only, each inside `dest`, within
    the snapshot limits; anything else is refused by name before a byte is written."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            members = tar.getmembers()
            _check_upload(members)
            for member in members:
                target = dest / member.name
                target.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None  # a regular file, checked above
                with source, open(target, "wb") as out:
                    out.write(source.read())
    except tarfile.TarError as err:
        raise CodeSnapshotError(f"the code upload is not a tar archive ({err})") from None


def _check_upload(members: list[tarfile.TarInfo]) -> None:
    if len(members) > MAX_FILES or sum(m.size for m in members) > MAX_TOTAL_BYTES:
        raise CodeSnapshotError(
            f"the code upload holds more than {MAX_FILES} files or {MAX_TOTAL_BYTES // 2**20} MiB"
        )
    for member in members:
        try:
            _safe_relative(member.name)
        except IntegrityError as err:
            raise CodeSnapshotError(str(err).replace("manifest", "upload")) from None
        if not member.isfile() or member.size > MAX_FILE_BYTES:
            raise CodeSnapshotError(
                f"{member.name}: the code upload may hold only regular files of at most "
                f"{MAX_FILE_BYTES // 2**20} MiB"
            )


def _safe_relative(path: object) -> PurePosixPath:
    """A manifest's path as a place inside the destination: never absolute, never `..`."""
    if not isinstance(path, str) or not path:
        raise IntegrityError(f"code manifest names a file {path!r}, which is not a path")
    rel = PurePosixPath(path)
    if rel.is_absolute() or ".." in rel.parts or "\\" in path or "\x00" in path:
        raise IntegrityError(f"code manifest names {path!r}, which leaves the code folder")
    return rel


def fetch(store: ObjectStore, snapshot: str, manifest_sha256: str, dest: Path) -> Path:
    """The snapshot's files in `dest` (a node's cache), every one checked by size and sha256,
    the manifest by the digest the run carries and the id recomputed from the files."""
    for entry in manifest_files(store, snapshot, manifest_sha256):
        fetch_verified(store, _blob_key(snapshot, entry.sha256), dest / entry.path,
                       entry.sha256, entry.bytes)  # fmt: skip
    return dest


def manifest_files(store: ObjectStore, snapshot: str, manifest_sha256: str) -> list[CodeFile]:
    """The files the snapshot's manifest lists, the manifest checked by the digest the run
    carries and the id recomputed from the files."""
    raw = store.get_bytes(manifest_key(snapshot))
    if hashlib.sha256(raw).hexdigest() != manifest_sha256:
        raise IntegrityError(
            f"{store.url}/{manifest_key(snapshot)} is not the code this run was submitted "
            f"with (sha256 {hashlib.sha256(raw).hexdigest()[:12]}…, the run has "
            f"{manifest_sha256[:12]}…): refusing to run it"
        )
    body = json.loads(raw)
    files = [
        CodeFile(_safe_relative(f["path"]).as_posix(), int(f["bytes"]), str(f["sha256"]))
        for f in body["files"]
    ]
    if snapshot_id(files) != snapshot:
        raise IntegrityError(f"code manifest {snapshot} lists files whose hashes give another id")
    return files


def materialize(
    store: ObjectStore, snapshot: str, files: list[CodeFile], cached: Path, dest: Path
) -> Path:
    """`dest` holding exactly the snapshot's `files`, each checked by sha256: a run's own copy
    of its code. The node cache's copy is shared by every run of the same code, and a run that
    could write there would plant a module in the next one's import path; a run's copy is made
    from the cache (from the store for any file whose cached bytes changed) and anything else
    found in `dest` (an extra file, a changed one) has it made again."""
    if _holds_exactly(dest, files):
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    for entry in files:
        target = dest / entry.path
        target.parent.mkdir(parents=True, exist_ok=True)
        source = cached / entry.path
        if source.is_file() and not source.is_symlink() and sha256_file(source) == entry.sha256:
            shutil.copyfile(source, target)
        else:
            fetch_verified(store, _blob_key(snapshot, entry.sha256), target,
                           entry.sha256, entry.bytes)  # fmt: skip
    return dest


def _holds_exactly(folder: Path, files: list[CodeFile]) -> bool:
    """Whether `folder` holds the listed files and nothing else (no link, no extra file), each
    with its listed sha256."""
    if not folder.is_dir():
        return False
    wanted = {entry.path: entry.sha256 for entry in files}
    found = 0
    for path in folder.rglob("*"):
        if path.is_symlink():
            return False
        if path.is_dir():
            continue
        rel = path.relative_to(folder).as_posix()
        if wanted.get(rel) != sha256_file(path):
            return False
        found += 1
    return found == len(wanted)
