"""Run PyTorch's own DCP tests with our four classes in place of stock DCP's.

    python scripts/dcp_upstream_tests.py PATH_TO_TESTS [--stock] [-- PYTEST_ARGS...]

PATH_TO_TESTS is a copy of ``test/distributed/checkpoint`` from the PyTorch source at the
installed release, fetched outside this repository (it is PyTorch's code, not ours). Without
``--stock``, ``FileSystemWriter``, ``FileSystemReader``, ``DefaultSavePlanner`` and
``DefaultLoadPlanner`` are rebound to ``SpreadFileSystemWriter``, ``VerifiedFileSystemReader``,
``SpreadSavePlanner`` and ``SafeLoadPlanner`` in every loaded ``torch.distributed.checkpoint``
module (and in PyTorch's checkpoint test helpers), before any test module is imported. The
rebinding runs from a ``sitecustomize`` on ``PYTHONPATH``, so the worker processes that
PyTorch's multi-process tests spawn get it too. Prints one JSON object last: per test id,
``passed`` / ``failed`` / ``skipped``.

Stored copies newer than the installed torch may import two testing helpers it lacks
(``HardwareClassification``, ``_get_device_type``); both modes add them, as plain stand-ins,
so that the comparison is the same on both sides.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import pkgutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REBIND_ENV = "FSDP_EXT_DCP_REBIND"

DEFAULT_FILES = [
    "test_file_system_checkpoint_cpu.py",
    "test_compatibility.py",
    "test_format_utils.py",
    "e2e/test_e2e_save_and_load.py",
]


def add_missing_test_helpers() -> None:
    """Stand-ins for testing helpers of newer PyTorch releases than the installed one."""
    import enum

    import torch
    from torch.testing._internal import common_utils
    from torch.testing._internal.distributed._tensor import common_dtensor

    if not hasattr(common_utils, "HardwareClassification"):

        class HardwareClassification(enum.Enum):
            GENERIC = "generic"
            ACCELERATOR = "accelerator"

        common_utils.HardwareClassification = HardwareClassification
    if not hasattr(common_dtensor, "_get_device_type"):
        common_dtensor._get_device_type = lambda world_size: (
            "cuda" if torch.cuda.device_count() >= world_size else "cpu"
        )


def rebind() -> dict[str, int]:
    """Put our classes where stock DCP's are; returns how many bindings changed, per name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import (
        DefaultLoadPlanner,
        DefaultSavePlanner,
    )
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

    from fsdp_ext.checkpoint import (
        SafeLoadPlanner,
        SpreadFileSystemWriter,
        SpreadSavePlanner,
        VerifiedFileSystemReader,
    )

    for info in pkgutil.walk_packages(dcp.__path__, "torch.distributed.checkpoint."):
        try:
            importlib.import_module(info.name)
        except Exception:  # optional dependencies of some submodules
            continue
    with contextlib.suppress(Exception):
        importlib.import_module("torch.testing._internal.distributed.checkpoint_utils")
    swaps = {
        "FileSystemWriter": (FileSystemWriter, SpreadFileSystemWriter),
        "FileSystemReader": (FileSystemReader, VerifiedFileSystemReader),
        "DefaultSavePlanner": (DefaultSavePlanner, SpreadSavePlanner),
        "DefaultLoadPlanner": (DefaultLoadPlanner, SafeLoadPlanner),
    }
    changed = dict.fromkeys(swaps, 0)
    for module_name, module in list(sys.modules.items()):
        if module is None or not (
            module_name.startswith("torch.distributed.checkpoint")
            or module_name == "torch.testing._internal.distributed.checkpoint_utils"
        ):
            continue
        for name, (stock, ours) in swaps.items():
            if getattr(module, name, None) is stock:
                setattr(module, name, ours)
                changed[name] += 1
    return changed


def site_hook() -> None:
    """What the generated sitecustomize calls in every Python process of the run."""
    add_missing_test_helpers()
    if os.environ.get(REBIND_ENV) == "1":
        rebind()


def run(tests: Path, stock: bool, files: list[str], pytest_args: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="dcp-upstream-") as work:
        site = Path(work) / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(
            "import importlib.util as _u\n"
            f"_s = _u.spec_from_file_location('_dcp_upstream', {str(Path(__file__).resolve())!r})\n"
            "_m = _u.module_from_spec(_s)\n"
            "_s.loader.exec_module(_m)\n"
            "_m.site_hook()\n"
        )
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(site), str(REPO), *filter(None, [env.get("PYTHONPATH")])]
        )
        env[REBIND_ENV] = "0" if stock else "1"
        report = Path(work) / "junit.xml"
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            *[str(tests / f) for f in files],
            *pytest_args,
        ]
        subprocess.run(command, env=env, cwd=work, timeout=3600, check=False)
        return outcomes(report)


def outcomes(report: Path) -> dict[str, str]:
    found = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("skipped") is not None:
            found[name] = "skipped"
        elif case.find("failure") is not None or case.find("error") is not None:
            found[name] = "failed"
        else:
            found[name] = "passed"
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests", type=Path, help="a copy of test/distributed/checkpoint")
    parser.add_argument("--stock", action="store_true", help="run with stock DCP's classes")
    parser.add_argument("--files", nargs="*", default=DEFAULT_FILES)
    args, pytest_args = parser.parse_known_args()
    if not args.tests.is_dir():
        parser.error(f"tests: {args.tests} is not a directory")
    results = run(args.tests, args.stock, args.files, [a for a in pytest_args if a != "--"])
    counts = {k: sum(v == k for v in results.values()) for k in ("passed", "failed", "skipped")}
    print(json.dumps({"mode": "stock" if args.stock else "fsdp_ext", **counts, "tests": results}))


if __name__ == "__main__":
    main()
