"""The torchtitan drop-in's checks that need no torchtitan (default run; the slow tests in
test_integrations_torchtitan.py run torchtitan itself)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fsdp_ext.integrations import torchtitan as tt_fsdp


def test_spmd_backend_other_than_partial_dtensor_is_refused_naming_the_fix():
    tt_fsdp.check_spmd_backend("partial_dtensor")
    for backend in ("spmd_types", "full_dtensor"):
        with pytest.raises(ValueError, match=r"choose spmd_backend='partial_dtensor'") as info:
            tt_fsdp.check_spmd_backend(backend)
        assert f"spmd_backend is {backend!r}" in str(info.value)
    with pytest.raises(ValueError, match=r"0\.3\.0's default"):
        tt_fsdp.check_spmd_backend("spmd_types")
    with pytest.raises(ValueError, match=r"must be one of .*got 'dtensor'"):
        tt_fsdp.check_spmd_backend("dtensor")


def test_importing_the_adapter_does_not_import_torchtitan():
    code = "import sys, fsdp_ext.integrations.torchtitan; print('torchtitan' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
