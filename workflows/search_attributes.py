"""The search attributes every TrainingRun carries, so runs can be filtered in the Temporal UI
(`ForgelineTeam = "research" AND ForgelinePhase = "AWAITING_APPROVAL"`) and with
`temporal workflow list --query`. A Temporal server must know them before a run starts:
`forgeline up` registers them with the dev server, and the control worker adds any missing one
on an existing server at start-up."""

from __future__ import annotations

from temporalio.common import SearchAttributeKey

TEAM = SearchAttributeKey.for_keyword("ForgelineTeam")
MODEL = SearchAttributeKey.for_keyword("ForgelineModel")
OWNER = SearchAttributeKey.for_keyword("ForgelineOwner")
PHASE = SearchAttributeKey.for_keyword("ForgelinePhase")
ALL = (TEAM, MODEL, OWNER, PHASE)
# For `temporal server start-dev --search-attribute NAME=TYPE`.
SEARCH_ATTRIBUTE_TYPES = {key.name: "Keyword" for key in ALL}
