"""The kernels are the subpackage ``fsdp_ext.kernels`` (the folder ``fsdp_ext/kernels/``), with
custom ops under ``torch.ops.fsdp_ext``, so that Triton's own ``triton_kernels`` (PyPI
``triton-kernels``, shipped in some inference images) installs beside the project without
either one shadowing the other, and a source checkout on ``PYTHONPATH`` imports its own
kernels with no package mapping and no import hook."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

BOTH = """
import importlib, json, sys
first = sys.argv[1]
order = ["triton_kernels", "fsdp_ext.kernels"]
if first == "ours":
    order.reverse()
mods = {name: importlib.import_module(name) for name in order}
import torch
import fsdp_ext.kernels.quantize_blockwise
print(json.dumps({
    "pypi": mods["triton_kernels"].__file__,
    "pypi_has": sorted(m for m in ("add_vectors", "rotary_embedding")
                       if importlib.util.find_spec("triton_kernels." + m)),
    "ours": mods["fsdp_ext.kernels"].__file__,
    "op": hasattr(torch.ops.fsdp_ext, "quantize_blockwise"),
}))
"""


def _copy_of_the_project(dest: Path) -> Path:
    shutil.copytree(
        ROOT / "fsdp_ext", dest / "fsdp_ext", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest)
    return dest


def _pip(venv: Path, *args: str) -> subprocess.CompletedProcess:
    """This environment's pip installs into ``venv`` (``--python``): the venv needs no pip of
    its own, whose ensurepip took 5 CPU-s."""
    cmd = [sys.executable, "-m", "pip", "--python", str(venv / "bin/python")]
    cmd += ["install", "-q", "--no-deps", *args]
    env = {**os.environ, "PIP_CONSTRAINT": "/dev/null"}
    env.pop("PYTHONPATH", None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def venv_with_pypi_triton_kernels(tmp_path_factory):
    """A fresh venv with this project installed from a wheel (as a user gets it) and PyPI's
    ``triton-kernels`` installed beside it; torch comes from the test's own environment."""
    tmp = tmp_path_factory.mktemp("venv")
    venv = tmp / "v"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    site = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    ours = sysconfig.get_paths()["purelib"]
    (site / "zz_torch_from_the_test_env.pth").write_text(
        f"import site; site.addsitedir({ours!r})\n"
    )
    src = _copy_of_the_project(tmp / "src")
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp / "dist")]
    env = {**os.environ, "PIP_CONSTRAINT": "/dev/null"}
    wheel = subprocess.run(
        [*build, "--no-build-isolation", str(src)], capture_output=True, text=True, timeout=300
    )
    if "invalid command 'bdist_wheel'" in wheel.stderr:  # a setuptools older than 70.1
        wheel = subprocess.run(
            [*build, str(src)], capture_output=True, text=True, timeout=300, env=env
        )
    assert wheel.returncode == 0, wheel.stderr
    project = _pip(venv, str(next((tmp / "dist").glob("fsdp_ext-*.whl"))))
    assert project.returncode == 0, project.stderr
    pip = _pip(venv, "triton-kernels")
    if pip.returncode != 0:
        pytest.skip(f"PyPI triton-kernels could not be installed: {pip.stderr.strip()[-300:]}")
    return venv


@pytest.mark.parametrize("first", ["pypi", "ours"])
def test_pypi_triton_kernels_and_ours_import_side_by_side(
    venv_with_pypi_triton_kernels, tmp_path, first
):
    import json

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [str(venv_with_pypi_triton_kernels / "bin/python"), "-c", BOTH, first],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # not the checkout: the wheel's fsdp_ext, not the source tree's
        env=env,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert str(venv_with_pypi_triton_kernels) in got["pypi"]
    assert got["pypi_has"] == ["add_vectors", "rotary_embedding"]
    assert got["ours"] == str(
        next(venv_with_pypi_triton_kernels.glob("lib/python*/site-packages/fsdp_ext/kernels"))
        / "__init__.py"
    )
    assert got["op"]


def test_a_source_checkout_on_pythonpath_imports_its_own_kernels(tmp_path):
    """A copy of the checkout (a second worktree, a GPU machine without the venv) imports the
    kernels beside its own fsdp_ext, not those of the checkout the venv was installed from."""
    copy = _copy_of_the_project(tmp_path / "checkout")
    code = "import fsdp_ext.kernels.backend as b, fsdp_ext\nprint(b.__file__, fsdp_ext.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(copy)},
    )
    assert out.returncode == 0, out.stderr
    kernels, package = out.stdout.split()
    assert kernels == str(copy / "fsdp_ext" / "kernels" / "backend.py")
    assert package == str(copy / "fsdp_ext" / "__init__.py")


def test_pyproject_installs_every_package_of_the_library():
    """``packages`` is an explicit list: a new room must be in it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "fsdp_ext").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert set(config["packages"]) == found
    assert "package-dir" not in config  # every package sits where its name says
