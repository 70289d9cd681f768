"""Who is calling, and what they may do: a person and their roles, from an API token.

Roles (what `forgeline tokens create --role` takes):

    read                  see runs, nodes, queues, models
    submit:TEAM           start runs on TEAM's queue (submit:* for every team)
    approve:TEAM          approve or reject the models of TEAM's runs (approve:* for every team)
    approve:model:MODEL   approve or reject versions of one model
    operate               nodes, the cluster, and other people's runs (cancel, resume)
    admin                 tokens and approval rules; implies every other role

A role to approve is necessary, not sufficient: the operators' approval rules
(registry.approvals) still say who may approve what, and nobody approves their own run unless
they allow it. Every role implies `read`.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

# The rule for the names people choose (workflows.contracts.names.NAME_PATTERN, which infra may not
# import): a person is an owner and an approver there. tests/infra/test_identity.py checks that
# the two agree.
PERSON_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
PERSON_RULE = "1-63 characters from a-z, 0-9, '.', '_', '-', starting with a letter or digit"
_NAME = PERSON_PATTERN.strip("^$")
ROLE_PATTERN = re.compile(
    rf"^(read|operate|admin|submit:(\*|{_NAME})|approve:(\*|{_NAME})|approve:model:{_NAME})$"
)
ROLE_RULE = "read, operate, admin, submit:TEAM, approve:TEAM (TEAM may be *) or approve:model:MODEL"


class InvalidIdentity(ValueError):
    """A person's name or a role that breaks its rule; the message says the rule."""


def canonical_person(name: str) -> str:
    """The one spelling of a person's name that is compared: 'Alice ' and 'alice' are the same
    person, and a look-alike in another script of Unicode is not (NFKC folds compatibility
    forms; anything left outside a-z, 0-9, '.', '_', '-' is refused)."""
    folded = unicodedata.normalize("NFKC", name).strip().lower()
    if not re.fullmatch(PERSON_PATTERN, folded):
        raise InvalidIdentity(f"person {name!r} is not a valid name: {PERSON_RULE}")
    return folded


def canonical_role(role: str) -> str:
    folded = unicodedata.normalize("NFKC", role).strip().lower()
    if not ROLE_PATTERN.fullmatch(folded):
        raise InvalidIdentity(f"role {role!r} is not one of: {ROLE_RULE}")
    return folded


@dataclass(frozen=True)
class Identity:
    """An authenticated caller: who they are (canonical) and the roles their token gives."""

    person: str
    roles: frozenset[str]
    token_id: str

    @property
    def is_admin(self) -> bool:
        return "admin" in self.roles

    def may_read(self) -> bool:
        return bool(self.roles)  # every role implies read

    def may_operate(self) -> bool:
        return self.is_admin or "operate" in self.roles

    def may_submit(self, team: str) -> bool:
        return self.is_admin or bool({"submit:*", f"submit:{team}"} & self.roles)

    def may_submit_somewhere(self) -> bool:
        """Submits to some team: may upload code for a run (the submit checks which team)."""
        return self.is_admin or any(r.startswith("submit:") for r in self.roles)

    def may_approve(self, team: str, model: str) -> bool:
        """Holds a role to decide on `model` of a run on `team`'s queue (the approval rules
        decide the rest)."""
        wanted = {"approve:*", f"approve:{team}", f"approve:model:{model}"}
        return self.is_admin or bool(wanted & self.roles)

    def of_team(self, team: str) -> bool:
        """Holds a role for `team` (submit:TEAM or approve:TEAM; a `*` role is every team's, an
        admin everyone's): may read what is the team's own, such as its runs' logs."""
        wanted = {"submit:*", f"submit:{team}", "approve:*", f"approve:{team}"}
        return self.is_admin or bool(wanted & self.roles)

    def may_act_on_run_of(self, owner: str) -> bool:
        """Cancel or resume a run: one's own, or anyone's as an operator."""
        return owner == self.person or self.may_operate()
