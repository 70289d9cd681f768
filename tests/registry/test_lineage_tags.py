"""A version's lineage tags, typed: the tags a version registered before the type carried read
back whole and write back the same, and tags this build cannot read are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.stored_format import StoredFormatError
from registry.lineage_tags import LineageTags
from registry.names import ARTIFACTS_TAG, CHECKPOINT_TAG, IDEMPOTENCY_TAG, SERVABLE_TAG

# Every tag of a version the local stack registered with the code before the type (a two-rank
# DDP run of the built-in GPT), read from MLflow's database.
STORED = Path(__file__).parent / "stored" / "version-tags-lineage-1.json"
WHERE = "hc-bars version 1"


def stored() -> dict[str, str]:
    return json.loads(STORED.read_text())


def test_tags_written_before_the_type_read_back_and_write_back_the_same() -> None:
    tags = stored()
    lineage = LineageTags.read(tags, WHERE)
    assert lineage.checkpoint_manifest_key == tags[CHECKPOINT_TAG]
    assert (lineage.checkpoint_step, lineage.eval_step) == (400, 400)
    assert lineage.git_dirty is True and lineage.servable is True
    assert lineage.val_loss == pytest.approx(2.3649) and lineage.code_snapshot is None
    assert lineage.eval_source is None  # registered before who measured it was recorded
    # Registration's own tags (its idempotency key, the artifacts' digests) are not lineage.
    lineage_only = {k: v for k, v in tags.items() if k not in (IDEMPOTENCY_TAG, ARTIFACTS_TAG)}
    assert lineage.dump() == {**lineage_only, "forgeline.lineage_format": "1"}


def test_a_version_of_a_user_s_script_carries_its_code() -> None:
    tags = {
        **stored(),
        "forgeline.code_snapshot": "0123456789abcdef0123456789abcdef",
        "forgeline.code_manifest_sha256": "ab" * 32,
        "forgeline.entrypoint": "train.py",
        "forgeline.eval_source": "script",
        SERVABLE_TAG: "false",
    }
    lineage = LineageTags.read(tags, WHERE)
    assert (lineage.entrypoint, lineage.servable) == ("train.py", False)
    assert lineage.eval_source == "script"
    assert LineageTags.read(lineage.dump(), WHERE) == lineage


def test_the_first_versions_lack_the_later_tags_and_still_read() -> None:
    later = ("eval_step", "eval_measured_on", "packages_sha256", "servable")
    first = {k: v for k, v in stored().items() if k.removeprefix("forgeline.") not in later}
    lineage = LineageTags.read(first, WHERE)
    assert lineage.eval_step is None and lineage.servable is True


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"forgeline.lineage_format": "2"}, "lineage_format '2'"),
        ({"forgeline.checkpoint_step": "four hundred"}, "field 'forgeline.checkpoint_step'"),
        ({"forgeline.git_dirty": "maybe"}, "field 'forgeline.git_dirty'"),
    ],
)
def test_tags_this_build_cannot_read_are_refused_by_name(change: dict, named: str) -> None:
    with pytest.raises(StoredFormatError) as refused:
        LineageTags.read({**stored(), **change}, WHERE)
    assert str(refused.value).startswith(WHERE) and named in str(refused.value)


def test_a_missing_tag_is_named() -> None:
    tags = stored()
    del tags["forgeline.dataset_manifest_sha256"]
    with pytest.raises(StoredFormatError) as refused:
        LineageTags.read(tags, WHERE)
    assert "'forgeline.dataset_manifest_sha256': field required" in str(refused.value)
