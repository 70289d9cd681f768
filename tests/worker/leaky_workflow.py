"""A workflow whose one activity fails, once, for the tests of what failures put in histories.

Its own module: the workflow sandbox re-imports the module a workflow is defined in, and this
one imports nothing but temporalio.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

LEAK_ACTIVITY = "leak"


@workflow.defn(name="LeakyWorkflow")
class LeakyWorkflow:
    @workflow.run
    async def run(self) -> None:
        await workflow.execute_activity(
            LEAK_ACTIVITY,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=RetryPolicy(maximum_attempts=1),
        )
