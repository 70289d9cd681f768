"""What the HTTP API signs of a decision, and how the control worker checks it: HMAC-SHA256,
under the store's decision key (registry/decision_key.py), of the run, the model version the
decision is on, the decision's every field and when it was signed. A signature holds for that
version of that run only, for `SIGNATURE_WINDOW` after it was made; changing the approver, the
verdict or the reason breaks it. Pure: the API and the activity both call it."""

from __future__ import annotations

import hashlib
import hmac
import json
from datetime import UTC, datetime, timedelta

from workflows.contracts.models import Decision, ModelVersionRef

# The API signs and sends at once; a signature seen long after was kept by someone to replay.
SIGNATURE_WINDOW = timedelta(minutes=10)
CLOCK_SKEW = timedelta(minutes=2)  # the API's clock may run ahead of Temporal's this much
_WHAT = "forgeline.decision/1"


def decision_message(run_id: str, version: ModelVersionRef, decision: Decision) -> bytes:
    """The bytes signed: every field that decides what the decision does, in one canonical
    form (sorted keys, no spaces), so the API and the worker hash the same bytes."""
    at = decision.signed_at
    signed_at = at.astimezone(UTC).isoformat(timespec="microseconds") if at else ""
    fields = {
        "what": _WHAT,
        "run": run_id,
        "model": version.model_name,
        "version": version.version,
        "approve": decision.approve,
        "approver": decision.approver,
        "reason": decision.reason,
        "override_gate": decision.override_gate,
        "signed_at": signed_at,
    }
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def signed(
    key: bytes, run_id: str, version: ModelVersionRef, decision: Decision, at: datetime
) -> Decision:
    """The decision with the API's signature, made at `at` (timezone-aware)."""
    dated = decision.model_copy(update={"signed_at": at, "signature": ""})
    mac = hmac.new(key, decision_message(run_id, version, dated), hashlib.sha256)
    return dated.model_copy(update={"signature": mac.hexdigest()})


def unsigned_because(
    key: bytes,
    run_id: str,
    version: ModelVersionRef,
    decision: Decision,
    received_at: datetime,
) -> str | None:
    """Why the decision is not one the API signed for this run's version (None: it is)."""
    api = "decisions count only through the Forgeline API (forgeline approve / reject)"
    if not decision.signature or decision.signed_at is None:
        return f"it carries no signature of the Forgeline API: {api}"
    want = hmac.new(key, decision_message(run_id, version, decision), hashlib.sha256)
    if not hmac.compare_digest(want.hexdigest(), decision.signature):
        return (
            f"its signature does not verify under the decision key: it was not signed by the "
            f"Forgeline API for run {run_id}, {version.model_name} version {version.version} "
            f"and this approver, verdict and reason; {api}"
        )
    age = received_at - decision.signed_at
    if age > SIGNATURE_WINDOW or age < -CLOCK_SKEW:
        return (
            f"it was signed at {decision.signed_at.isoformat()} and reached the run at "
            f"{received_at.isoformat()}: a signature holds for {SIGNATURE_WINDOW} after it is "
            "made; decide again"
        )
    return None
