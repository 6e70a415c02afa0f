"""Leaves a process behind in a session of its own, as torchrun's workers live, and exits.

    orphan.py SHARED_DIR

Each rank writes the orphan's pid to SHARED_DIR/orphan<RANK>.pid.
"""

import os
import subprocess
import sys
from pathlib import Path

orphan = subprocess.Popen(["sleep", "300"], start_new_session=True)
Path(sys.argv[1], f"orphan{os.environ['RANK']}.pid").write_text(str(orphan.pid))
