"""Loaded by every Python process inside a job's container (infra.containers puts this folder
on PYTHONPATH, and it holds nothing else): Forgeline's packages, from the node, go after the
image's own, so the image's torch and libraries win and Forgeline's rank code is importable."""

import os
import site

for folder in os.environ.get("FORGELINE_NODE_PACKAGES", "").split(os.pathsep):
    if folder:
        site.addsitedir(folder)
