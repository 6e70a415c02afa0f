"""The main job reads in one sitting: examples/train.py is the model, its parallelization,
the loop and the save; launching, reporting and recovery live beside it (launch.py,
report.py, recovery.py, parallel.py)."""

from pathlib import Path

TRAIN = Path(__file__).resolve().parent.parent / "examples" / "train.py"
LIMIT = 320


def test_train_py_is_at_most_320_lines():
    lines = len(TRAIN.read_text().splitlines())
    assert lines <= LIMIT, f"examples/train.py has {lines} lines; the limit is {LIMIT}"
