"""A user's module names are the user's: a code folder's own `trainer.py`, `infra/`, `worker.py`.

The rank entry and the SDK live in Forgeline's top-level packages (`trainer`, `infra`,
`workflows`, ...: the design keeps those folders), and Python has one table of imported modules.
Once Forgeline's `trainer` is imported, a script's `import trainer` gets Forgeline's, not the
`trainer.py` beside it, and a script at home never had that problem.

So before the script's first line the rank entry calls `make_way_for(code_dir)`:

1. everything the SDK will ever import is imported now (`SDK_MODULES`, and the store's class for
   the job's URL: `infra.store.factory.preload`);
2. Forgeline's modules under the top-level names the code folder also has (`trainer.py`,
   `infra/`, a folder with or without `__init__.py`) leave `sys.modules`. They keep working:
   Forgeline's modules hold references to each other, not names, and `_MOVED_ASIDE` keeps them
   alive;
3. a finder in front resolves those names from the code folder alone, so a folder `infra/`
   without `__init__.py` is the script's namespace package, as it is at home, and not shadowed
   by Forgeline's regular package further down `sys.path`.

Names the code folder does not have stay Forgeline's, as before. The price is one rule: no
module a rank loads may import a project package inside a function (the import would find the
user's module), which tests/trainer/test_user_module_names.py checks on every module the rank
loads.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from infra.store.factory import preload

# The top-level names Forgeline's wheel installs, but `forgeline` itself: a script that imports
# the SDK means Forgeline's.
PLATFORM_PACKAGES = ("activities", "dataprep", "infra", "registry", "trainer", "worker",
                     "workflows")  # fmt: skip
# What a user's script can reach through `import forgeline`, imported before the script runs.
SDK_MODULES = (
    "forgeline.errors",
    "forgeline.randomness",
    "forgeline.reporting",
    "forgeline.step",
    "forgeline.training",
)

_MOVED_ASIDE: dict[str, ModuleType] = {}


class _CodeFolderFirst(importlib.abc.MetaPathFinder):
    """Finds the names the code folder took from Forgeline in the code folder, and only there."""

    def __init__(self, code_dir: Path, names: Sequence[str]) -> None:
        self.code_dir = str(code_dir)
        self.names = frozenset(names)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names:
            return None  # submodules are found through their package's own __path__
        return importlib.machinery.PathFinder.find_spec(fullname, [self.code_dir])


def taken_names(code_dir: Path) -> tuple[str, ...]:
    """Forgeline's top-level names that the code folder has a module or a folder of."""
    return tuple(
        name
        for name in PLATFORM_PACKAGES
        if (code_dir / f"{name}.py").is_file() or (code_dir / name).is_dir()
    )


def make_way_for(code_dir: Path, store_url: str, twin_store_url: str = "") -> tuple[str, ...]:
    """Import what the SDK needs, then give the code folder its own names (see the module's
    docstring); returns the names given. Call once, before the script runs. A folder that takes
    none of Forgeline's names costs nothing: the SDK is imported when the script imports it."""
    names = taken_names(code_dir)
    if not names:
        return names
    for module in SDK_MODULES:
        importlib.import_module(module)
    preload(store_url, twin_store_url)
    for key in list(sys.modules):
        if key.split(".", 1)[0] in names:
            _MOVED_ASIDE[key] = sys.modules.pop(key)
    sys.meta_path.insert(0, _CodeFolderFirst(code_dir, names))
    importlib.invalidate_caches()
    return names
