"""Claim ROOT for a job with lease LEASE and say how it went, as one JSON line per claim.

    claim_out.py ROOT LEASE hold     own ROOT, print {"owned": generation}, keep it until killed
    claim_out.py ROOT LEASE try...   one claim per word on stdin's lines: each prints
                                     {"refused": message, "s": seconds} or
                                     {"took": generation, "s": seconds} (then releases it)

Seconds are this process's monotonic clock; under libfaketime its wall clock is skewed.
"""

import json
import sys
import threading
import time
import warnings

from fsdp_ext.job import DirectoryOwnedError, claim

root, lease, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3]
warnings.simplefilter("ignore")
if mode == "hold":
    owned = claim(root, lease_s=lease)
    print(json.dumps({"owned": owned.owner.generation, "wall": time.time()}), flush=True)
    threading.Event().wait()  # time.sleep fails under libfaketime (real monotonic)
for _line in sys.stdin:
    t0 = time.monotonic()
    try:
        owned = claim(root, lease_s=lease)
    except DirectoryOwnedError as exc:
        print(json.dumps({"refused": str(exc), "s": time.monotonic() - t0}), flush=True)
        continue
    print(json.dumps({"took": owned.owner.generation, "s": time.monotonic() - t0}), flush=True)
    owned.release()
