"""The operators' approval rules, as operators write them (TOML, `forgeline approvals apply`):

    [defaults]
    allow_self_approval = false      # the submitter may not approve their own model

    [teams.research]
    approvers = ["bob", "carol"]     # may approve the models of runs on this team's queue
    max_val_loss = 3.0               # the eval gate for them

    [models.shakespeare]
    approvers = ["dave"]

Someone listed for the model or for the run's team may decide; with no list anywhere, anyone
but the submitter may. The strictest gate that applies wins. The rules are owned by operators,
not by run specs: a researcher can tighten their own gate in the spec but cannot loosen these.

They live in the object store (`settings/approvals.json`, a `StoredApprovals`), the one place
that the API, which writes them, and the control worker's gate, which reads them, both reach:
in the shipped deployments each has a state folder of its own. Rules installed before (the
state folder's `approvals.toml`) are copied into the store the first time they are read.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from infra.errors import NotOnTwin, ObjectNotFound
from infra.store.protocol import ObjectStore
from infra.stored_format import StoredFormatError, StoredRecord
from registry.errors import ApprovalsInvalid

APPROVALS_KEY = "settings/approvals.json"
APPROVALS_FORMAT = "forgeline.approvals/1"
# Where rules were installed before they moved to the store: the state folder of whoever wrote
# them (the API's, in a deployment).
APPROVALS_FILE = "approvals.toml"
_Person = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$")]


class _Rules(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    approvers: list[_Person] = []
    allow_self_approval: bool | None = None
    max_val_loss: float | None = Field(None, gt=0)


class ApprovalsFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    defaults: _Rules = _Rules()
    teams: dict[str, _Rules] = {}
    models: dict[str, _Rules] = {}


class StoredApprovals(StoredRecord):
    """The installed rules as stored, with who installed them and when."""

    VERSIONS: ClassVar[tuple[Any, ...]] = (APPROVALS_FORMAT,)
    WHAT: ClassVar[str] = "approval rules record"

    format: str = APPROVALS_FORMAT
    rules: ApprovalsFile
    installed_by: str = ""
    installed_at: str = ""  # ISO time


@dataclass(frozen=True)
class Rules:
    """The rules for one model of one team, and where they came from."""

    approvers: tuple[str, ...]
    allow_self_approval: bool
    max_val_loss: float | None
    source: str


def parse_approvals(text: str, where: str) -> ApprovalsFile:
    try:
        return ApprovalsFile.model_validate(tomllib.loads(text))
    except tomllib.TOMLDecodeError as err:
        raise ApprovalsInvalid(f"{where} is not valid TOML: {err}") from None
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()
        )
        raise ApprovalsInvalid(
            f"{where}: {problems} (sections: [defaults], [teams.NAME], [models.NAME]; keys: "
            "approvers, allow_self_approval, max_val_loss)"
        ) from None


def install_approvals(store: ObjectStore, rules: ApprovalsFile, by: str) -> None:
    """Replace the installed rules whole, in one put (a reader sees the old rules or the new,
    never a mix). `rules` is a checked model: a typo never reaches the gate."""
    record = StoredApprovals(rules=rules, installed_by=by, installed_at=_now())
    store.put_bytes(APPROVALS_KEY, record.dump_bytes())


def load_approvals(store: ObjectStore, home: Path | None = None) -> ApprovalsFile | None:
    """The installed rules (None: none installed). Rules that a build before installed in
    `home`'s `approvals.toml` are copied into the store first, create-if-absent, so rules
    installed through the API meanwhile win and nothing installed before is lost."""
    try:
        raw = store.get_bytes(APPROVALS_KEY)
    except NotOnTwin:
        # The primary is down and its twin has no rules: the replicator copies them within a
        # pass of their being installed (infra.replication), so none were installed, but for
        # rules installed in the last pass before the outage. Waiting for the primary instead
        # would hold every run at its gate for the whole outage.
        before = _installed_before(home)
        return None if before is None else before.rules
    except ObjectNotFound:
        before = _installed_before(home)
        if before is None:
            return None
        store.put_if_absent(APPROVALS_KEY, before.dump_bytes())
        raw = store.get_bytes(APPROVALS_KEY)
    try:
        return StoredApprovals.parse(raw, f"{store.url}/{APPROVALS_KEY}").rules
    except StoredFormatError as err:
        raise ApprovalsInvalid(
            f"{err}: install the rules again (forgeline approvals apply)"
        ) from None


def _installed_before(home: Path | None) -> StoredApprovals | None:
    path = None if home is None else home / APPROVALS_FILE
    if path is None or not path.is_file():
        return None
    rules = parse_approvals(path.read_text(encoding="utf-8"), str(path))
    return StoredApprovals(rules=rules, installed_by=str(path), installed_at=_now())


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def rules_for(approvals: ApprovalsFile | None, model: str, team: str) -> Rules:
    if approvals is None:
        return Rules((), False, None, "no rules installed: defaults")
    found = [
        (name, rules)
        for name, rules in (
            (f"model {model}", approvals.models.get(model)),
            (f"team {team}", approvals.teams.get(team)),
        )
        if rules is not None
    ]
    listed = sorted({person for _, rules in found for person in rules.approvers})
    everything = [rules for _, rules in found] + [approvals.defaults]
    self_approval = next(
        (r.allow_self_approval for r in everything if r.allow_self_approval is not None), False
    )
    bars = [r.max_val_loss for r in everything if r.max_val_loss is not None]
    source = "approval rules: " + (", ".join(name for name, _ in found) or "defaults")
    return Rules(
        approvers=tuple(listed or approvals.defaults.approvers),
        allow_self_approval=self_approval,
        max_val_loss=min(bars, default=None),
        source=source,
    )
