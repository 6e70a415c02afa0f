"""Codecs by name: a :class:`~fsdp_ext.comm.config.LoCoConfig` names its codec here.

Adding a codec is one file (a :class:`~fsdp_ext.comm.codec.Codec` subclass) and one line in
:data:`CODECS`; code outside the library registers its own with :func:`register_codec`.
A factory takes the config object that names it and returns the codec.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fsdp_ext.comm.absmax_codec import AbsmaxCodec
from fsdp_ext.comm.blockwise_int8_codec import BlockwiseInt8Codec
from fsdp_ext.comm.codec import Codec

__all__ = ["CODECS", "make_codec", "register_codec"]

CodecFactory = Callable[[Any], Codec]

CODECS: dict[str, CodecFactory] = {
    "absmax": AbsmaxCodec.from_config,  # LoCo and qgZ, 4 or 8 bits
    "int8_blockwise": BlockwiseInt8Codec.from_config,  # qwZ weights, no feedback
}


def register_codec(name: str, factory: CodecFactory) -> None:
    """Make ``LoCoConfig(codec=name)`` build its codec with ``factory(config)``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise TypeError(f"factory must be callable (config -> Codec), got {factory!r}")
    if name in CODECS and CODECS[name] is not factory:
        raise ValueError(f"a codec named {name!r} is already registered")
    CODECS[name] = factory


def make_codec(name: str, config: Any) -> Codec:
    """The codec registered as ``name``, built from ``config``."""
    if name not in CODECS:
        raise ValueError(f"codec must be one of {sorted(CODECS)}, got {name!r}")
    codec = CODECS[name](config)
    if not isinstance(codec, Codec):
        made = type(codec).__name__
        raise TypeError(f"the factory of codec {name!r} returned a {made}, not a Codec")
    return codec
