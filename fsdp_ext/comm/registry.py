"""Codecs by name, and the names of communication every part of fsdp-ext speaks.

A codec is one file (a :class:`~fsdp_ext.comm.codec.Codec` subclass and its options
dataclass, whose ``codec`` class attribute names it) plus one line in :data:`CODECS`; code
outside the library adds its own with :func:`register_codec`. Its name then is a
``CommConfig`` preset, a ``--comm`` choice of the main job and a candidate of ``--comm auto``:
each of those reads the names here (:func:`gradient_names`, :func:`weight_names`) and the
configs they stand for (:func:`preset`), and nothing else lists them.

The vocabulary:

- ``"stock"``: FSDP's own collective (gradients in the reduce dtype, weights in the param dtype);
- every gradient codec's name (``"loco"``, ``"q4"``, ...): the reduce-scatter (and the HSDP
  all-reduce) sends that codec's payload;
- every weight codec's name (``"int8"``): the parameter all-gather sends its payload, in
  forward and backward; the same name with ``"_forward"`` appended: in forward only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from fsdp_ext.comm.absmax_codec import AbsmaxCodec, LoCoConfig, Q4Config
from fsdp_ext.comm.blockwise_int8_codec import BlockwiseInt8Codec
from fsdp_ext.comm.codec import Codec
from fsdp_ext.comm.weight_config import WeightQuantConfig

__all__ = [
    "CARRIES",
    "CODECS",
    "FORWARD_ONLY",
    "STOCK",
    "Registered",
    "gradient_names",
    "make_codec",
    "preset",
    "register_codec",
    "unregister_codec",
    "weight_names",
]

STOCK = "stock"  # FSDP's own collective
FORWARD_ONLY = "_forward"  # a weight codec's name + this: quantised in forward only
CARRIES = ("gradients", "weights")

CodecFactory = Callable[[Any], Codec]


@dataclass(frozen=True)
class Registered:
    """One codec: ``factory(options) -> Codec``; ``options``, its options class (called
    with no arguments it gives the preset); ``carries``, ``"gradients"`` or ``"weights"``."""

    factory: CodecFactory
    options: Callable[[], Any]
    carries: str = "gradients"


CODECS: dict[str, Registered] = {
    "loco": Registered(AbsmaxCodec.from_config, LoCoConfig),  # 4-bit, LoCo error feedback
    "q4": Registered(AbsmaxCodec.from_config, Q4Config),  # 4-bit, no feedback (qgZ)
    "int8": Registered(BlockwiseInt8Codec.from_config, WeightQuantConfig, "weights"),  # qwZ
}
BUILT_IN = tuple(CODECS)


def register_codec(
    name: str, factory: CodecFactory, *, options: Callable[[], Any], carries: str = "gradients"
) -> None:
    """Add a codec: ``options()`` is its default options (whose ``codec`` is ``name``), and
    ``factory(options)`` builds it. From here on ``name`` is a preset, a ``--comm`` choice
    (gradient codecs) and an ``auto`` candidate."""
    if not isinstance(name, str) or not name.isidentifier() or name == STOCK:
        raise ValueError(f"name must be an identifier other than {STOCK!r}, got {name!r}")
    if name.endswith(FORWARD_ONLY):
        raise ValueError(f"name must not end in {FORWARD_ONLY!r} (the forward-only presets)")
    if not callable(factory) or not callable(options):
        raise TypeError(f"factory and options must be callable, got {factory!r}, {options!r}")
    if carries not in CARRIES:
        raise ValueError(f"carries must be one of {CARRIES}, got {carries!r}")
    entry = Registered(factory, options, carries)
    if name in CODECS and CODECS[name] != entry:
        raise ValueError(f"a codec named {name!r} is already registered")
    CODECS[name] = entry


def unregister_codec(name: str) -> None:
    """Remove a codec added with :func:`register_codec` (a test's, at its end); the
    library's own stay."""
    if name in BUILT_IN:
        raise ValueError(f"{name!r} is one of the library's codecs {BUILT_IN}; it stays")
    CODECS.pop(name, None)


def _names(carries: str) -> list[str]:
    return [name for name, entry in CODECS.items() if entry.carries == carries]


def gradient_names() -> tuple[str, ...]:
    """What the gradient reduce-scatter can send: ``"stock"``, then every gradient codec."""
    return (STOCK, *_names("gradients"))


def weight_names() -> tuple[str, ...]:
    """What the parameter all-gather can send: ``"stock"``, then every weight codec in
    forward and backward, and in forward only."""
    return (STOCK, *(n + tail for n in _names("weights") for tail in ("", FORWARD_ONLY)))


def preset(name: str, carries: str = "gradients", **options: Any) -> Any:
    """The options ``name`` stands for (None: ``"stock"``), with ``options`` set where the
    codec has such a field (``group_size=...``: every built-in codec has one)."""
    allowed = gradient_names() if carries == "gradients" else weight_names()
    if name not in allowed:
        raise ValueError(f"{carries} must be one of {list(allowed)}, got {name!r}")
    if name == STOCK:
        return None
    forward_only = carries == "weights" and name.endswith(FORWARD_ONLY)
    config = CODECS[name.removesuffix(FORWARD_ONLY) if forward_only else name].options()
    known = {f.name for f in fields(config)}
    config = replace(config, **{k: v for k, v in options.items() if k in known})
    return replace(config, backward=False) if forward_only else config


def make_codec(config: Any) -> Codec:
    """The codec ``config`` (a codec's options) names, built from it."""
    name = getattr(config, "codec", None)
    if name not in CODECS:
        raise ValueError(
            f"{type(config).__name__}.codec must be one of {sorted(CODECS)}, got {name!r}"
        )
    codec = CODECS[name].factory(config)
    if not isinstance(codec, Codec):
        made = type(codec).__name__
        raise TypeError(f"the factory of codec {name!r} returned a {made}, not a Codec")
    return codec
