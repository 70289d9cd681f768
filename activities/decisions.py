"""The control worker's check of a decision's signature: the run asks it before it counts a
decision, since only the API and the control worker can read the decision key
(registry/decision_key.py) and a workflow's history is readable by whoever reads Temporal."""

from __future__ import annotations

from temporalio import activity

from activities.errors import domain_errors
from infra.store.protocol import ObjectStore
from registry.decision_key import DecisionKey
from workflows.contracts.decision_signature import unsigned_because
from workflows.contracts.models import DecisionCheck, DecisionCheckInput


class DecisionActivities:
    def __init__(self, store: ObjectStore) -> None:
        self.key = DecisionKey(store, holder="the control worker")

    @activity.defn(name="verify_decision")
    def verify_decision(self, inp: DecisionCheckInput) -> DecisionCheck:
        """Whether the API signed this decision for this run's version. A key that cannot be
        read is never taken as a yes: a corrupt one fails the decision naming it, a store that
        is down is retried."""
        with domain_errors():
            key = self.key.get()
        why = unsigned_because(key, inp.run_id, inp.version, inp.decision, inp.received_at)
        if why is not None:
            activity.logger.warning("run %s: refused a decision: %s", inp.run_id, why)
        return DecisionCheck(refused=why)
