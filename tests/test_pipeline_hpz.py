"""hpZ under ``build_pipeline`` where it does something: 8 ranks as pp 2 x dp 4 on nodes of
2, so each stage's dp group spans two nodes and the post-forward copies stay in the node.

FSDP builds a post-forward mesh for every unit with an int ``reshard_after_forward``, and
each build is a rendezvous of the whole world; the stages hold different units, so the
stages' ranks made different numbers of those calls and the job hung in ``build_pipeline``.
It now builds every stage's mesh in one call first.
"""

from fsdp_ext.comm import CommConfig, WeightQuantConfig
from fsdp_ext.testing import run_distributed
from tests.test_comm_enable import _rank_pipeline

WORLD, NODE, MICROBATCHES = 8, 2, 2  # 8 rows per step: 2 per dp rank, 1 per microbatch


def _both() -> dict:
    zeropp_weights = CommConfig(weights=WeightQuantConfig(group_size=32), hpz=True, node_size=NODE)
    return {
        "stock": _rank_pipeline(None, MICROBATCHES),
        "hpz": _rank_pipeline(zeropp_weights, MICROBATCHES),
    }


def test_hpz_on_stages_that_span_nodes():
    results = run_distributed(_both, WORLD, timeout=240)
    for r in results:
        assert len(r["hpz"]["dp_ranks"]) == 4  # two nodes of 2 in each stage's dp group
        # every unit of the stage keeps its post-forward copy on its node's 2 ranks
        assert set(r["hpz"]["secondary"].values()) == {NODE}
        w = r["hpz"]["weights"]
        assert w.intra_node_gathers > 0 and w.intra_node_bytes > 0
        assert w.quantized_gathers > 0
        # int8 weights move the losses a little, and only a little
        assert r["hpz"]["losses"] != r["stock"]["losses"]
        for got, want in zip(r["hpz"]["losses"], r["stock"]["losses"], strict=True):
            assert abs(got - want) < 1e-2
    assert len({tuple(r["hpz"]["losses"]) for r in results}) == 1
