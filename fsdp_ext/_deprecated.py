"""Old public names, kept for one release: each use warns, naming what replaces it.

A rename keeps the old name as an alias (DESIGN.md's API contract), looked up through a
package's ``__getattr__`` so the warning fires where the user's code reads it. The category
is ``FutureWarning``, which Python shows to end users by default (``DeprecationWarning``
is hidden outside ``__main__``). Python's default filter shows it once per call site.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["REMOVED_IN", "RENAMED", "renamed_attribute", "warn_deprecated"]

REMOVED_IN = "0.3"
# old public name -> new public name, in the same package
RENAMED = {"QuantizedAllGather": "WeightQuantConfig"}


def warn_deprecated(old: str, new: str, *, stacklevel: int = 3) -> None:
    """One ``FutureWarning``: ``old`` goes in ``REMOVED_IN``; use ``new``."""
    warnings.warn(
        f"{old} is deprecated and will be removed in fsdp-ext {REMOVED_IN}: use {new}",
        FutureWarning,
        stacklevel=stacklevel,
    )


def renamed_attribute(module: str, name: str, namespace: dict[str, Any]) -> Any:
    """A package's ``__getattr__``: the object under its new name, with the warning."""
    new = RENAMED.get(name)
    if new is None or new not in namespace:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warn_deprecated(f"{module}.{name}", f"{module}.{new} (the same class)", stacklevel=4)
    return namespace[new]
