"""Errors of the trainer. Corrupt or missing inputs will not pass on a retry; rank crashes may."""


class TrainerError(Exception):
    """Base class for trainer errors."""


class CheckpointError(TrainerError):
    """No usable checkpoint: every candidate manifest is missing files or fails its hashes."""


class DataError(TrainerError):
    """The token shards cannot feed the model as configured (too short, wrong dtype)."""


class RanksFailed(TrainerError):
    """The torchrun ranks of this node exited with an error."""


class RanksHung(RanksFailed):
    """The ranks made no progress for too long: a stuck collective, a frozen process."""


class NodeFault(RanksFailed):
    """A rank's device or its driver said it is broken (trainer.platform_faults): the node, not
    the run, is at fault, and must not be given the restarted gang again."""


class UserCodeFailed(RanksFailed):
    """The user's rank script failed before its first step: the same on every attempt."""
