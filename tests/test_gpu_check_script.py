"""scripts/gpu-check.sh on a machine without CUDA: one "no CUDA device" line, exit code 2."""

import subprocess
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu-check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_gpu_check_says_no_cuda_device_and_exits_2():
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout.strip().splitlines() == ["gpu-check: no CUDA device"]
