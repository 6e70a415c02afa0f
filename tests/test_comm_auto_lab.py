"""--comm auto's probe behind a capped link (slow: two lab jobs)."""

import pytest

from fsdp_ext.lab import Cluster
from tests.lab_helpers import PROGRAMS, require_lab


@pytest.mark.slow
@pytest.mark.parametrize("mbit", [50, 200])
def test_the_probe_measures_the_capped_link(mbit):
    """2 nodes x 2 ranks behind tbf at ``mbit`` each way: the inter-node bandwidth the probe
    reports (bytes per node link, the node's 2 ranks sharing it) is the cap, within what a
    loaded 2-core machine allows (what auto then chooses depends on the codec speed the
    load leaves, so it is only printed)."""
    require_lab(storage=False)
    with Cluster(2, 2, f"{mbit}mbit", storage=False) as lab:
        result = lab.run([str(PROGRAMS / "auto_probe.py")], timeout=240)
    assert result.returncode == 0, result.output[-3000:]
    got = result.last_json()
    cap = mbit * 1e6 / 8
    assert 0.5 * cap < got["inter_bandwidth"] < 1.5 * cap, (got, cap)
    assert got["intra_bandwidth"] > got["inter_bandwidth"]
    print(got)
