"""``fsdp_ext.kernels`` in a source checkout that is on ``sys.path`` but not installed.

An install maps the top-level folder ``triton_kernels/`` to ``fsdp_ext.kernels`` (pyproject's
``package-dir``). A checkout run through ``PYTHONPATH`` (a second worktree, a GPU machine
without the project's venv) has no such mapping, or one that points at another checkout, so
this finder maps the name to the folder beside this very package, and only when that folder
belongs to this project (never to PyPI's ``triton_kernels`` beside an installed package).
Importing this module installs the finder; ``fsdp_ext/__init__.py`` imports it first.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

NAME = "fsdp_ext.kernels"
KERNELS_DIR = Path(__file__).resolve().parent.parent / "triton_kernels"


class _SourceTreeKernels(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != NAME:
            return None
        return importlib.util.spec_from_file_location(
            NAME, KERNELS_DIR / "__init__.py", submodule_search_locations=[str(KERNELS_DIR)]
        )


def _is_this_project() -> bool:
    pyproject = KERNELS_DIR.parent / "pyproject.toml"
    return (
        (KERNELS_DIR / "codec_common.py").is_file()
        and pyproject.is_file()
        and ('name = "fsdp-ext"' in pyproject.read_text())
    )


def _install() -> None:
    """Put the finder first, once, where this package runs from its source tree."""
    installed = (Path(__file__).resolve().parent / "kernels").is_dir()
    if installed or not _is_this_project():
        return
    if not any(isinstance(f, _SourceTreeKernels) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceTreeKernels())


_install()
