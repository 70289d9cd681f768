"""Ranks exchange typed JSON (trainer.typed_exchange), not pickles: what arrives is parsed as
the declared type, and a record that is not one is refused."""

from __future__ import annotations

import pydantic
import pytest

from trainer.checkpoint_manifest import CheckpointFile
from trainer.typed_exchange import all_gather_typed, broadcast_typed


@pytest.mark.usefixtures("one_rank")
def test_records_cross_as_their_type_and_nothing_else() -> None:
    entry = CheckpointFile(name="__0_0.distcp", key="runs/r/x", bytes=3, sha256="a" * 64)
    [(fenced, files)] = all_gather_typed((False, [entry]), tuple[bool, list[CheckpointFile]])
    assert fenced is False and files == [entry] and isinstance(files[0], CheckpointFile)
    assert broadcast_typed(("k", True, None), tuple[str | None, bool, str | None], 0, None) == (
        "k", True, None,
    )  # fmt: skip
    # What a peer sends is parsed, not run: a value of another shape is refused.
    with pytest.raises(pydantic.ValidationError):
        all_gather_typed({"__reduce__": "os.system"}, tuple[bool, list[CheckpointFile]])
