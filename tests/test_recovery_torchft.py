"""``benchmarks/recovery.py --peer torchft --quick``: both systems lose node 1 and finish.

Slow (four lab jobs, about 8 minutes on the loaded machine). torchft comes from the package
index: ``pip install torchft==0.2.0`` into the venv, or ``pip install --target DIR`` and
``TORCHFT_PATH=DIR`` (its OpenTelemetry dependencies too); without it the test skips with
the import error.
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.slow


def test_torchft_side_by_side_quick():
    from benchmarks.recovery import main
    from benchmarks.recovery_torchft import torchft_missing
    from tests.lab_helpers import require_lab

    require_lab()
    path = os.environ.get("TORCHFT_PATH")
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = os.pathsep.join([path, env.get("PYTHONPATH", "")])
    missing = torchft_missing(env=env)
    if missing is not None:
        pytest.skip(f"torchft does not import here: {missing}")
    out = main(["--peer", "torchft", "--quick", "--timeout", "400"])
    for system in ("ours", "torchft"):
        assert out[f"finished_{system}"], out
        assert out[f"recovery_s_{system}"] is not None and out[f"recovery_s_{system}"] > 0, out
        assert out[f"lost_steps_{system}"] is not None and out[f"lost_steps_{system}"] >= 0, out
        assert 0 < out[f"goodput_{system}"] <= 1.1, out
        assert out[f"final_loss_{system}"] is not None, out
