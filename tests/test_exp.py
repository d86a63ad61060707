"""The kernels' float32 exp (engine/exp.py) against float64's: within half a float32 ulp of the exact
value (plus the float64 approximation's own ~1e-12), special values exact, and vectorized where
the kernels call it."""
import numba
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from refengine.engine.exp import exp32
from refengine.engine.jit import OPTIONS, jit

HALF_ULP = 0.5 + 1e-4  # the float64 series' error, in float32 ulps, is far below 1e-4


@jit
def _exp_all(x, out):
    for i in range(x.shape[0]):
        out[i] = exp32(x[i])


def _exp(x):
    out = np.empty_like(x)
    _exp_all(np.ascontiguousarray(x, dtype=np.float32), out)
    return out


def _ulps(got, x):
    """|got - exp(x)| in float32 ulps of the exact value (denormal results: in units of 2^-149)."""
    exact = np.exp(x.astype(np.float64))
    spacing = np.spacing(exact.astype(np.float32)).astype(np.float64)
    return np.abs(got.astype(np.float64) - exact) / np.maximum(spacing, 2.0 ** -149)


def test_every_result_is_within_half_an_ulp_across_the_whole_range():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-104, 89, 1 << 20), rng.uniform(-1, 1, 1 << 16), rng.uniform(-88, -87, 1 << 14),
                        np.arange(-103, 89, dtype=np.float64) * np.log(2)]).astype(np.float32)
    x = x[np.exp(x.astype(np.float64)) < np.finfo(np.float32).max]  # above, the float32 result is inf (below)
    assert _ulps(_exp(x), x).max() <= HALF_ULP


def test_special_values_and_the_ends_of_the_range():
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 88.72283, 88.72284, 89.5, 1e30, -103.97, -104.5, -1e30],
                 dtype=np.float32)
    got = _exp(x)
    assert np.isnan(got[0])
    assert got[1] == np.inf and got[2] == 0 and got[3] == got[4] == 1
    assert got[5] == np.float32(3.4027985e38) and got[6:9].tolist() == [np.inf] * 3  # the largest, then overflow
    assert got[9] == np.float32(2.0 ** -149) and got[10] == got[11] == 0                  # the smallest, then 0


@given(st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-120.0, max_value=88.5))
def test_any_float32_within_half_an_ulp(value):
    x = np.array([value], dtype=np.float32)
    assert _ulps(_exp(x), x)[0] <= HALF_ULP


def test_a_loop_over_it_is_vectorized():
    """What it is for: numba's math.exp compiles to a call per value."""
    fresh = numba.njit(**{**OPTIONS, "cache": False})(_exp_all.py_func)  # a cached load keeps no assembly
    fresh(np.zeros(16, dtype=np.float32), np.empty(16, dtype=np.float32))
    assembly = "\n".join(fresh.inspect_asm().values())
    assert "pd\t%zmm" in assembly or "pd\t%ymm" in assembly
