"""The two-worker schedule of `make test` (tests/conftest.py): every module that builds a lab
runs in the one lab unit, so no two labs ever run side by side."""

from pathlib import Path

from tests.conftest import _start_rank, _uses_a_lab

TESTS = Path(__file__).resolve().parent
LAB_IMPORTS = ("fsdp_ext.lab", "tests.lab_helpers", "from fsdp_ext import lab")


def _builds_a_lab(path: Path) -> bool:
    return any(name in path.read_text() for name in LAB_IMPORTS)


def test_every_module_that_builds_a_lab_is_in_the_lab_unit():
    modules = [p for p in sorted(TESTS.glob("test_*.py")) if p.name != Path(__file__).name]
    labs = [p.name for p in modules if _builds_a_lab(p)]
    assert len(labs) >= 20  # the scan found them (test_lab_*, benchmarks, recovery)
    assert [name for name in labs if not _uses_a_lab(f"tests/{name}::t")] == []
    # and the named list holds no module that has stopped building one
    from tests.conftest import LAB_MODULES

    assert sorted(m for m in LAB_MODULES if f"{m}.py" not in labs) == []


def test_the_labs_start_first_then_the_longest_modules():
    ranks = [
        _start_rank(nodeid)
        for nodeid in (
            "tests/test_lab_links.py::t",
            "tests/test_checkpoint_async_saves.py::t",
            "tests/test_ownership_hosts.py::t",
            "tests/test_codec.py::t",
        )
    ]
    assert ranks == sorted(ranks) and len(set(ranks)) == 4
