"""``--comm auto``: measure the links and codecs at startup, predict each way to communicate,
pick the fastest (the same on every rank). See docs/comm.md#comm-auto."""

from fsdp_ext.comm.auto.cost import (
    Candidate,
    CodecSpeed,
    Hop,
    Layout,
    Measurements,
    Prediction,
    candidates,
    codec_keys,
    predict,
)
from fsdp_ext.comm.auto.decide import AutoDecision, auto_config, choose, pick, slowest
from fsdp_ext.comm.auto.measure import codec_speed, measure, time_codecs
from fsdp_ext.comm.auto.units import unit_sizes

__all__ = [
    "AutoDecision",
    "Candidate",
    "CodecSpeed",
    "Hop",
    "Layout",
    "Measurements",
    "Prediction",
    "auto_config",
    "candidates",
    "choose",
    "codec_keys",
    "codec_speed",
    "measure",
    "pick",
    "predict",
    "slowest",
    "time_codecs",
    "unit_sizes",
]
