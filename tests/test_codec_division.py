"""The codec's division, one IEEE division per group instead of one per element
(``codec_common.div_round_half_up``, used by ``quantize_ef`` and ``quantize_blockwise``),
against ``floor(h / s + 0.5)`` with IEEE division, bit for bit: ties ``(k + 1/2) s`` and
their neighbours, divisors with mantissas near all ones and near zero, subnormal divisors
and numerators, every exponent the codec can meet (``s < 2^126``, ``|h / s| <= 2^8``). The
kernel helper itself runs, through the interpreter.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
import torch

from fsdp_ext.kernels.codec_common import div_round_half_up, tl, triton

pytestmark = [
    pytest.mark.usefixtures("triton_interpreter_fma"),
    pytest.mark.filterwarnings("ignore:overflow encountered"),
]
ROWS, COLS = 1024, 64

if triton is not None:

    @triton.jit
    def _divide_kernel(h_ptr, s_ptr, q_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        at = rows[:, None] * COLS + tl.arange(0, COLS)[None, :]
        q = div_round_half_up(tl.load(h_ptr + at), tl.load(s_ptr + rows))
        tl.store(q_ptr + at, q)


def _cases(programs: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``[programs * ROWS]`` divisors and ``[programs * ROWS, COLS]`` numerators."""
    rng = np.random.default_rng(seed)
    n = programs * ROWS
    mantissa = rng.integers(0, 1 << 23, n)
    mantissa[: n // 4] = (1 << 23) - 1 - rng.integers(0, 64, n // 4)
    mantissa[n // 4 : n // 2] = rng.integers(0, 64, n // 4)
    exponent = rng.integers(0, 253, n)  # subnormal (0) up to 2^125
    s = ((exponent << 23) | mantissa).astype(np.uint32).view(np.float32)
    s[s == 0] = np.float32(2.0**-149)
    s64 = s.astype(np.float64)[:, None]
    kind = rng.integers(0, 4, (n, COLS))
    ratio = (rng.random((n, COLS)) * 2 - 1) * 2.0 ** rng.integers(-160, 9, (n, COLS))
    tie = rng.integers(-256, 256, (n, COLS)) + 0.5
    h = np.where(kind == 0, s64 * ratio, s64 * tie).astype(np.float32)
    h = np.where(kind == 2, np.nextafter(h, np.float32(np.inf)), h)
    h = np.where(kind == 3, np.nextafter(h, np.float32(-np.inf)), h)
    keep = np.isfinite(h) & (np.abs(h.astype(np.float64) / s64) <= 2.0**8)
    return s, np.where(keep, h, np.float32(0.0))


def _check(programs: int, seed: int) -> None:
    s, h = _cases(programs, seed)
    q = torch.empty(h.shape, dtype=torch.float32)
    _divide_kernel[(programs,)](torch.from_numpy(h), torch.from_numpy(s), q, ROWS, COLS)
    with np.errstate(all="ignore"):
        want = np.floor(h / s[:, None] + np.float32(0.5))
    got = q.numpy()
    wrong = got.view(np.int32) != want.view(np.int32)
    where = list(zip(*np.nonzero(wrong), strict=True))[:3]
    assert not wrong.any(), [(h[i], s[i[0]], got[i], want[i]) for i in where]


def test_one_division_per_group_rounds_as_ieee_division():
    _check(programs=16, seed=0)  # 1M pairs


@pytest.mark.slow
def test_one_division_per_group_rounds_as_ieee_division_on_many_more_pairs():
    for seed in range(1, 9):
        _check(programs=128, seed=seed)  # 8 x 8M pairs


def test_the_check_can_fail():
    """The same sequence without the scaling of small divisors: tiny groups round wrongly."""
    s = np.full(ROWS, 2.0**-140, dtype=np.float32)
    h = (s.astype(np.float64)[:, None] * (np.arange(COLS) + 0.5)).astype(np.float32)
    r = np.float32(1) / s[:, None]  # infinite: 1 / s overflows
    with np.errstate(all="ignore"):
        unscaled = np.floor(h * r + np.float32(0.5))
        want = np.floor(h / s[:, None] + np.float32(0.5))
    assert (unscaled != want).any()
    q = torch.empty(h.shape, dtype=torch.float32)
    _divide_kernel[(1,)](torch.from_numpy(h), torch.from_numpy(s), q, ROWS, COLS)
    assert np.array_equal(q.numpy(), want)
