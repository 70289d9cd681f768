"""A run's own code through the HTTP API: the tar of a train.code folder in, a content-addressed
snapshot in the store out (infra.code_snapshot), and the check that a submit names that
snapshot. The API reads no folder of the submitter's: what runs is what was uploaded."""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
from pathlib import Path

from infra import code_snapshot
from infra.errors import ObjectNotFound
from infra.requirements import LOCK_FILE, REQUIREMENTS_FILE
from infra.store.protocol import ObjectStore
from worker.request_limits import BodyCap
from workflows.contracts.models import CodeRef
from workflows.contracts.spec import RunSpec

# A snapshot's limit and room for the tar's headers: a bigger body is refused as it streams in
# (worker/request_limits.py), unread when its Content-Length says so.
MAX_UPLOAD_BYTES = code_snapshot.MAX_TOTAL_BYTES + 16 * 2**20
UPLOAD_CAP = BodyCap(
    MAX_UPLOAD_BYTES,
    "point train.code at the training code only, or list the rest in .gitignore",
)
# Each upload holds its body in memory and its files on disk while it is published: a few at a
# time per API process (`forgeline run` uploads once per submit).
MAX_UPLOADS_AT_ONCE = 4
_SNAPSHOT_ID = re.compile(r"[0-9a-f]{32}")
_UPLOAD_FIX = "upload the folder with POST /v1/code (`forgeline run` and Client.submit do)"


class CodeRefused(Exception):
    def __init__(self, status: int, message: str, fix: str = _UPLOAD_FIX) -> None:
        super().__init__(message)
        self.status, self.fix = status, fix


def publish_upload(store: ObjectStore, data: bytes) -> CodeRef:
    """Unpack the tar in a scratch folder and publish its files as they arrived: the snapshot id
    comes from them, so the submitter can check it against the one it computed."""
    with tempfile.TemporaryDirectory(prefix="forgeline-code-") as scratch:
        try:
            code_snapshot.unpack(data, Path(scratch))
            # The .gitignore rules were applied where the folder was packed (the snapshot id
            # the submitter checks is the one these files make). Applied again here they would
            # leave out nothing but could cost anything: a regex per pattern per file, and one
            # pattern with four wildcards took 15 s on one long name.
            published = code_snapshot.publish(store, Path(scratch), gitignore=False)
        except code_snapshot.CodeSnapshotError as err:
            raise CodeRefused(422, str(err)) from None
    return CodeRef.model_validate(published, from_attributes=True)


def check_code(store: ObjectStore, spec: RunSpec, code: CodeRef | None) -> None:
    """A spec with train.code comes with the snapshot its folder was uploaded as, and one
    without comes with none; the snapshot must be in the store, with the manifest it names."""
    if spec.train.code is None:
        if code is not None:
            raise CodeRefused(422, "code: sent with a spec that names no train.code",
                              fix="set train.code, or leave code out")  # fmt: skip
        return
    if code is None:
        raise CodeRefused(422, "train.code: the API cannot read a folder of yours; send the "
                               "snapshot it was uploaded as in the submit's code")  # fmt: skip
    if not _SNAPSHOT_ID.fullmatch(code.snapshot_id):
        raise CodeRefused(422, f"code: {code.snapshot_id!r} is not a snapshot id (32 hex digits)")
    key = code_snapshot.manifest_key(code.snapshot_id)
    try:
        raw = store.get_bytes(key) if code.manifest_key == key else None
    except ObjectNotFound:
        raw = None
    if raw is None or hashlib.sha256(raw).hexdigest() != code.manifest_sha256:
        raise CodeRefused(422, f"code: the store holds no snapshot {code.snapshot_id} with "
                               f"manifest sha256 {code.manifest_sha256[:12]}…")  # fmt: skip
    # The script is looked for in the snapshot: train.code names a folder of the submitter's
    # machine, and the API looks at no folder of its own on a spec's word.
    entry = spec.train.entrypoint or ""
    paths = {f["path"] for f in json.loads(raw)["files"]}
    if ":" not in entry and entry not in paths:
        raise CodeRefused(422, f"train.entrypoint: no file {entry!r} in the code uploaded "
                               f"(snapshot {code.snapshot_id})",
                          fix="name a script of the train.code folder, relative to it")  # fmt: skip
    declared = {REQUIREMENTS_FILE, LOCK_FILE} & paths
    if spec.train.image is not None and declared:
        raise CodeRefused(422, f"train.image: the code uploaded declares its own packages "
                               f"({', '.join(sorted(declared))}), which a run in an image does "
                               "not install: the image's packages are the ones its ranks get",
                          fix="put them in the image, or leave out train.image")  # fmt: skip
