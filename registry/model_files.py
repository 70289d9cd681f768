"""Every file a registered version's model folder holds, typed: what registration records and
what `serve` and `generate` check a downloaded folder against before anything in it runs.

A version's folder is not only its weights: `MLmodel` names the code MLflow runs, `code/` and
the models-from-code entry are that code, `requirements.txt` says what gets installed. Each is
recorded (path, bytes, sha256) in a file of the version's MLflow run (`model_files.json`), and
that file's own sha256 is a tag of the version (`forgeline.model_files_sha256`): MLflow tag
values are bounded in length, a model's code is not. A folder that differs from its record in
any file, lacks one, or holds one more (a planted module is imported like any other) is refused
naming the file.

Light on purpose: no MLflow here (the loader imports it late).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, field_validator

from infra.digest import is_sha256_hex, sha256_file
from infra.stored_format import StoredRecord

MODEL_FILES_ARTIFACT = "model_files.json"  # in the version's MLflow run, beside the model
MODEL_FILES_FORMAT = 1


class ModelFile(BaseModel):
    """One file of the model folder: its path there ('/'-separated), size and sha256."""

    model_config = ConfigDict(frozen=True)

    path: str
    bytes: int
    sha256: str

    @field_validator("path")
    @classmethod
    def _inside(cls, path: str) -> str:
        # The record names files to check, never a place to read outside the downloaded folder.
        parts = PurePosixPath(path)
        if parts.is_absolute() or ".." in parts.parts or "\\" in path or not path:
            raise ValueError(f"{path!r} is not a path inside the model folder")
        return path

    @field_validator("sha256")
    @classmethod
    def _hex(cls, sha256: str) -> str:
        if not is_sha256_hex(sha256):
            raise ValueError("not a lowercase hex sha256")
        return sha256


class ModelFiles(StoredRecord):
    """The record of a version's model folder, file by file."""

    VERSION_FIELD: ClassVar[str] = "format"
    VERSIONS: ClassVar[tuple[Any, ...]] = (MODEL_FILES_FORMAT,)
    WHAT: ClassVar[str] = "record of a model version's files"

    format: int = MODEL_FILES_FORMAT
    files: list[ModelFile]

    def by_path(self) -> dict[str, ModelFile]:
        return {entry.path: entry for entry in self.files}

    def first_difference(self, folder: Path) -> str | None:
        """What first differs between `folder` and this record, naming the file; None: none."""
        recorded, present = self.by_path(), files_in(folder)
        extra = sorted(set(present) - set(recorded))
        if extra:
            return (
                f"{extra[0]} is in its model folder but not in the record its registration made "
                "(added since: code there would be imported)"
            )
        for path, entry in sorted(recorded.items()):
            local = present.get(path)
            if local is None:
                return f"{path} is missing, though its registration recorded it"
            actual = sha256_file(local)
            if actual != entry.sha256:
                return (
                    f"{path} is not the file it was registered with (sha256 {actual[:12]}…, "
                    f"registered {entry.sha256[:12]}…)"
                )
        return None


def files_in(folder: Path) -> dict[str, Path]:
    """Every file under `folder` (symbolic links included, as files), by its '/'-separated
    path relative to it."""
    return {
        path.relative_to(folder).as_posix(): path
        for path in folder.rglob("*")
        if path.is_file() or path.is_symlink()
    }
