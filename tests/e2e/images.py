"""A container image for the tests, built from this machine's own files: there is no registry
to pull from here. It holds Debian's Python 3.11 (not the node's interpreter: the ranks must
run the image's) with its standard library, the shared libraries they load, torch and the
packages torch imports, and a marker file a test looks for through /proc/<pid>/root."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

IMAGE_PYTHON = Path("/usr/bin/python3.11")
MARKER = Path("etc/forgeline-test-image")
# torch and what it imports, as installed beside the node's (their dist-info folders too).
PACKAGES = ("torch", "torchgen", "functorch", "numpy", "numpy.libs", "sympy", "mpmath",
            "networkx", "jinja2", "markupsafe", "filelock", "fsspec",
            "typing_extensions.py")  # fmt: skip
DISTRIBUTIONS = ("torch", "numpy", "sympy", "mpmath", "networkx", "jinja2", "markupsafe",
                 "filelock", "fsspec", "typing_extensions")  # fmt: skip


def image_name() -> str:
    """Named by the torch it holds: a torch upgrade builds a new image."""
    torch = importlib.metadata.version("torch").replace("+", "-")
    return f"localhost/forgeline-test/torch:py3.11-{torch}"


def ensure_test_image() -> str:
    """The test image, built once per machine (about 30 s); its name."""
    name = image_name()
    if subprocess.run(["podman", "image", "exists", name]).returncode == 0:
        return name
    with tempfile.TemporaryDirectory(prefix="forgeline-image-") as scratch:
        root = Path(scratch)
        _lay_out(root)
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["podman", "import", "--quiet", "-", name], stdin=tar.stdout, check=True,
                       capture_output=True)  # fmt: skip
        assert tar.wait() == 0
    return name


def _lay_out(root: Path) -> None:
    site = root / "usr/local/lib/python3.11/dist-packages"
    site.mkdir(parents=True)
    (root / "tmp").mkdir()
    (root / "usr/bin").mkdir(parents=True)
    shutil.copy2(IMAGE_PYTHON, root / "usr/bin/python3.11")
    (root / "usr/bin/python3").symlink_to("python3.11")
    shutil.copytree("/usr/lib/python3.11", root / "usr/lib/python3.11", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", "dist-packages"))  # fmt: skip
    node_site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    for name in PACKAGES:
        source = node_site / name
        if source.is_dir():
            shutil.copytree(source, site / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
        elif source.exists():
            shutil.copy2(source, site / name)
    for dist in DISTRIBUTIONS:
        for info in node_site.glob(f"{dist}-*.dist-info"):
            shutil.copytree(info, site / info.name)
    for library in _libraries(root):
        target = root / library.relative_to("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(library, target)
    # Merged /usr, as Debian has it: the loader is looked for at /lib64.
    (root / "lib").symlink_to("usr/lib")
    (root / "lib64").symlink_to("usr/lib64")
    (root / "etc").mkdir(exist_ok=True)
    (root / MARKER).write_text("forgeline test image\n")


def _libraries(root: Path) -> set[Path]:
    """Every shared library the interpreter and the copied extensions load from the system."""
    objects = [root / "usr/bin/python3.11", *root.rglob("*.so"), *root.rglob("*.so.*")]
    found: set[Path] = set()
    for chunk in range(0, len(objects), 200):
        listed = subprocess.run(["ldd", *map(str, objects[chunk : chunk + 200])],
                                capture_output=True, text=True).stdout  # fmt: skip
        for line in listed.splitlines():
            parts = line.split()
            path = parts[2] if "=>" in parts and len(parts) > 2 else parts[0] if parts else ""
            if path.startswith("/") and not path.startswith(str(root)):
                # At the folder it is looked for in (/lib64 is /usr/lib64: merged /usr).
                found.add(Path(path).parent.resolve() / Path(path).name)
    return {p for p in found if p.exists()}
