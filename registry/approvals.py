"""The operators' approval rules, one TOML file in the state folder (`approvals.toml`):

    [defaults]
    allow_self_approval = false      # the submitter may not approve their own model

    [teams.research]
    approvers = ["bob", "carol"]     # may approve the models of runs on this team's queue
    max_val_loss = 3.0               # the eval gate for them

    [models.shakespeare]
    approvers = ["dave"]

Someone listed for the model or for the run's team may decide; with no list anywhere, anyone
but the submitter may. The strictest gate that applies wins. The file is owned by operators, not
by run specs: a researcher can tighten their own gate in the spec but cannot loosen these.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from registry.errors import ApprovalsInvalid

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


def approvals_toml(rules: ApprovalsFile) -> str:
    """The rules as the TOML file operators write (for rules that arrive as data, from the
    API): `parse_approvals` reads back what this writes."""
    sections = [("defaults", rules.defaults)]
    sections += [(f"teams.{json.dumps(name)}", r) for name, r in sorted(rules.teams.items())]
    sections += [(f"models.{json.dumps(name)}", r) for name, r in sorted(rules.models.items())]
    lines: list[str] = []
    for header, r in sections:
        lines.append(f"[{header}]")
        lines.append(f"approvers = {json.dumps(list(r.approvers))}")
        if r.allow_self_approval is not None:
            lines.append(f"allow_self_approval = {str(r.allow_self_approval).lower()}")
        if r.max_val_loss is not None:
            lines.append(f"max_val_loss = {r.max_val_loss!r}")
        lines.append("")
    return "\n".join(lines)


def install_approvals(home: Path, text: str) -> Path:
    """Replace the installed rules whole with `text`, checked: runs read them when their model
    is registered, and a typo must never lock every run out of approval."""
    parse_approvals(text, "the new rules")
    target = home / APPROVALS_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(target)
    return target


def load_approvals(home: Path) -> ApprovalsFile | None:
    path = home / APPROVALS_FILE
    if not path.is_file():
        return None
    return parse_approvals(path.read_text(), str(path))


def rules_for(approvals: ApprovalsFile | None, model: str, team: str) -> Rules:
    if approvals is None:
        return Rules((), False, None, f"no {APPROVALS_FILE}: defaults")
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
    source = f"{APPROVALS_FILE}: " + (", ".join(name for name, _ in found) or "defaults")
    return Rules(
        approvers=tuple(listed or approvals.defaults.approvers),
        allow_self_approval=self_approval,
        max_val_loss=min(bars, default=None),
        source=source,
    )
