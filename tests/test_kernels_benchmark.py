"""Smoke test of benchmarks/kernels.py: it times every kernel and reports its JSON."""

from benchmarks.kernels import main


def test_benchmark_reports_every_kernel(capsys):
    result = main(["--quick", "--numel", str(2**16), "--reps", "2", "--device", "cpu"])
    assert set(result["kernels"]) == {
        "quantize_ef",
        "dequantize_reduce",
        "permute_indices",
        "quantize_blockwise",
        "dequantize_blockwise",
    }
    for entry in result["kernels"].values():
        assert entry["gb_per_s"] > 0 and entry["fraction_of_copy"] > 0
    assert result["min_fraction_of_copy"] == min(
        result["kernels"][k]["fraction_of_copy"] for k in ("quantize_ef", "dequantize_reduce")
    )
    assert result["min_fraction_of_copy_all"] == min(
        entry["fraction_of_copy"] for entry in result["kernels"].values()
    )
    # the 7B-block qwZ decode, scaled down on a CPU: both ways timed, launches counted (none
    # on a CPU, where the torch reference runs)
    block = result["qwz_unit_decode_7b"]
    assert (block["params"], block["shards"]) == (9, 8)
    assert block["one_launch_ms"] > 0 and block["per_parameter_loop_ms"] > 0
    assert block["launches"] == {"per_parameter_loop": 0, "one_launch": 0}
    # the fast CPU path against the reference, side by side, writing the same bits
    codec = result["cpu_codec"]
    assert codec["bit_exact"] is True and codec["threads"] == 1
    assert result["cpu_codec_speedup_vs_reference"] == codec["quantize_ef"]["speedup"] > 0
    assert codec["dequantize_reduce"]["speedup"] > 0
    assert codec["quantize_ef"]["torch_path_speedup"] > 0  # the path without a C compiler
    if result["cpu_codec_path"] == "native C":  # built here from a cold cache
        assert 0 < result["cpu_codec_compile_s"] < 120
    else:
        assert result["cpu_codec_path"] == "plain torch" and result["cpu_codec_compile_s"] is None
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith('{"bench": "kernels"')
