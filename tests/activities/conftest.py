"""The trainer tests' fixture (a real snapshot in a store, tiny torchrun jobs against it): the
evaluate activity is tested on checkpoints a real run committed."""

from tests.trainer.conftest import trainer

__all__ = ["trainer"]
