"""RowStorage's rounding against tests/low_precision_oracle.py.

The oracle is written from the specification (the hash, and "the
neighbour above ``x`` with probability ``(x - lo) / (hi - lo)``"), not
from the TensorFlow code; these tests compare the public
``RowStorage.encode`` and ``row_storage.random_bits`` with it bit for bit,
and check the rounding's statistics (unbiased; small updates not lost).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tests import low_precision_oracle as oracle
from tpu_embedding.row_storage import RowStorage
from tpu_embedding.row_storage import random_bits

DTYPES16 = ("bfloat16", "float16")
ROUNDINGS = ("stochastic", "nearest")

#: Row ids across the int64 range: small, around 2**32, and huge.
ROW_EDGES = (0, 1, 2**32 - 1, 2**32, 2**32 + 1, 2**40 + 12345, 2**62 + 3)


def _encode(storage, values, *, key=0, rows=None, step=0, table="t"):
  """``storage.encode`` of float32 ``values`` as float64 numpy values
  (exact: every 16-bit value is a float32)."""
  values = np.asarray(values, np.float32)
  if rows is None:
    rows = np.arange(values.shape[0])
  out = storage.encode(
    tf.constant(values),
    key=key,
    rows=tf.constant(np.asarray(rows, np.int64)),
    step=tf.constant(step, tf.int64),
    table=table,
  )
  assert out.dtype == storage.stored_dtype(key)
  return tf.cast(out, tf.float32).numpy().astype(np.float64)


def _assert_same(got, want, values):
  """Equal values and signs of zero; names the first few that differ."""
  same = (got == want) & (np.signbit(got) == np.signbit(want))
  if not same.all():
    where = np.argwhere(~same)
    shown = [
      f"{tuple(int(i) for i in w)}: x={values[tuple(w)]!r} "
      f"got {got[tuple(w)]!r} want {want[tuple(w)]!r}"
      for w in where[:8]
    ]
    signs = (
      f"{np.sum(~same & (values > 0))} with x > 0, "
      f"{np.sum(~same & (values < 0))} with x < 0"
    )
    pytest.fail(
      f"{len(where)} of {got.size} differ ({signs}):\n" + "\n".join(shown)
    )


def _rows(rng, n):
  """``n`` distinct row ids, small and beyond 2**32."""
  rows = np.concatenate(
    [np.array(ROW_EDGES), rng.integers(0, 2**62, size=n - len(ROW_EDGES))]
  )
  assert len(np.unique(rows)) == n
  return rows


def _varied(rng, dtype_name, dim):
  """A ``[n, dim]`` float32 array with values of every kind the rounding
  meets: magnitudes across the type's range, both signs, zeros, -0.0,
  subnormals, values of the type, ties and values next to powers of 2."""
  top = np.log10(6e4) if dtype_name == "float16" else 30.0
  bottom = -8.0 if dtype_name == "float16" else -38.0
  spread = 10.0 ** rng.uniform(bottom, top, size=2000)
  spread *= rng.choice([-1.0, 1.0], size=spread.size)
  values = oracle.type_values(dtype_name)
  values = values[np.abs(values) <= (6e4 if dtype_name == "float16" else 1e30)]
  exact = rng.choice(values, size=300)
  lo = rng.choice(values[:-1], size=300)
  hi = values[np.searchsorted(values, lo) + 1]
  ties = (lo + hi) / 2  # halfway: exact in float32
  powers = 2.0 ** rng.integers(-20, 15, size=100)
  near_powers = np.concatenate(
    [
      np.nextafter(powers.astype(np.float32), np.float32(0)),
      np.nextafter(powers.astype(np.float32), np.float32(np.inf)),
    ]
  )
  special = [0.0, -0.0, 1e-40, -1e-40, 1.0, -1.0, 1.0 + 2**-12, 3.0e-8]
  if dtype_name == "float16":
    subnormal = 10.0 ** rng.uniform(np.log10(6e-8), -6.0, size=300)
    subnormal *= rng.choice([-1.0, 1.0], size=subnormal.size)
    special += [65504.0, -65504.0, 65500.3, 2.0**-24, 2.0**-25, -(2.0**-25)]
    special += [2.0**-14 - 2.0**-30, 6e-8, -6e-8, 1e-8]
  else:
    subnormal = 10.0 ** rng.uniform(-42.0, -38.0, size=100)  # float32's
    special += [1e30, -1e30, 3.0e38 / 1e8]
  x = np.concatenate(
    [spread, exact, ties, near_powers, subnormal, np.array(special)]
  ).astype(np.float32)
  if dtype_name == "float16":
    assert np.abs(x).max() <= 65504
  x = np.concatenate([x, np.zeros(-len(x) % dim, np.float32)])
  x = rng.permutation(x)
  return x.reshape(-1, dim)


def test_oracle_nearest_agrees_with_numpy_casts(rng):
  # The oracle's neighbours checked once against the casts numpy has.
  x = (rng.normal(size=20000) * 10.0 ** rng.uniform(-9, 4.5, 20000)).astype(
    np.float32
  )
  x = x[np.abs(x) <= 65504]
  want = x.astype(np.float16).astype(np.float64)
  _assert_same(oracle.nearest_round(x, "float16"), want, x)


@pytest.mark.parametrize(
  "seed,stream,step",
  [
    (0, 0, 0),
    (1, 1, 1),
    (12345, 2, 7),
    (-1, 0, 2**33 + 5),  # the seed and step taken mod 2**32
    (2**40 + 3, 3, 2**32 - 1),
    (0x9E3779B9, 5, -1),
  ],
)
def test_random_bits_match_the_oracle(rng, seed, stream, step):
  rows = np.concatenate(
    [np.array(ROW_EDGES + (2**63 - 1,)), rng.integers(0, 2**63 - 1, 57)]
  )
  got = random_bits(
    seed,
    stream,
    tf.constant(step, tf.int64),
    tf.constant(rows, tf.int64),
    13,
  )
  assert got.dtype == tf.uint32
  np.testing.assert_array_equal(
    got.numpy(), oracle.random_bits(seed, stream, step, rows, 13)
  )


def test_random_bits_use_every_input():
  rows = np.array([5, 5 + 2**32, 5 + 2**33], np.int64)

  def bits(seed=0, stream=0, step=0, rows=rows):
    return random_bits(
      seed, stream, tf.constant(step, tf.int64), tf.constant(rows), 4
    ).numpy()

  base = bits()
  # The high half of a row id matters; the columns differ.
  assert len({tuple(r) for r in base}) == 3
  assert len(set(base[0])) == 4
  for other in (bits(seed=1), bits(stream=1), bits(step=1)):
    assert (other != base).mean() > 0.9


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("dtype_name", DTYPES16)
@pytest.mark.parametrize("key", [0, 2])
def test_encode_matches_the_oracle(rng, dtype_name, rounding, key):
  dim = 8
  x = _varied(rng, dtype_name, dim)
  rows = _rows(rng, x.shape[0])
  seed, step = 20260, 123457
  storage = RowStorage(
    dtype_name, slots=dtype_name, rounding=rounding, seed=seed
  )
  got = _encode(storage, x, key=key, rows=rows, step=step)
  if rounding == "nearest":
    want = oracle.nearest_round(x, dtype_name)
  else:
    bits = oracle.random_bits(seed, key, step, rows, dim)
    want = oracle.stochastic_round(x, bits, dtype_name)
  _assert_same(got, want, x)


@pytest.mark.parametrize("dtype_name", DTYPES16)
@pytest.mark.parametrize(
  "negative", [False, True], ids=["positive", "negative"]
)
def test_stochastic_encode_matches_the_oracle_by_sign(
  rng, dtype_name, negative
):
  # Values in [1, 2) of one sign: a narrower view of the test above.
  x = rng.uniform(1.0, 2.0, size=(512, 4)).astype(np.float32)
  x = -x if negative else x
  rows = np.arange(512) + 2**34
  storage = RowStorage(dtype_name, seed=3)
  got = _encode(storage, x, rows=rows, step=9)
  want = oracle.stochastic_round(
    x, oracle.random_bits(3, 0, 9, rows, 4), dtype_name
  )
  _assert_same(got, want, x)


@pytest.mark.parametrize("dtype_name", DTYPES16)
def test_values_of_the_type_and_zeros_are_kept(dtype_name, rng):
  values = oracle.type_values(dtype_name)
  x = rng.choice(values[np.abs(values) <= 6e4], size=(200, 5))
  x[0, :2] = [0.0, -0.0]
  x = x.astype(np.float32)
  for rounding in ROUNDINGS:
    got = _encode(RowStorage(dtype_name, rounding=rounding), x, step=4)
    _assert_same(got, x.astype(np.float64), x)


def _unbiased_cases():
  cases = []
  for dtype_name, xs in (
    (
      "bfloat16",
      (1.0 + 0.3 * 2**-7, 1.0 + 2**-12, -(3.0 + 0.77 * 2**-6), 1e-3),
    ),
    ("float16", (1.0 + 0.3 * 2**-10, -(1.0 + 2**-13), 3.7e-7, 1e-8, 777.7)),
  ):
    cases += [(dtype_name, float(np.float32(x))) for x in xs]
  return cases


@pytest.mark.parametrize("dtype_name,x", _unbiased_cases())
@pytest.mark.parametrize("across", ["rows", "steps"])
def test_stochastic_rounding_is_unbiased(dtype_name, x, across):
  n = 20000
  exact, lo, hi = (v.item() for v in oracle.neighbours(x, dtype_name))
  assert not exact and lo < x < hi
  p = (x - lo) / (hi - lo)
  storage = RowStorage(dtype_name, seed=11)
  if across == "rows":
    got = _encode(storage, np.full((n, 1), x), rows=np.arange(n) + 2**33)
  else:
    # One row, its draws at n steps: n columns stand in for n calls
    # where the steps differ; here 200 steps of 100 columns.
    got = np.concatenate(
      [
        _encode(storage, np.full((1, 100), x), rows=[77], step=s)
        for s in range(n // 100)
      ],
      axis=None,
    )
  assert set(np.unique(got)) <= {lo, hi}
  mean = got.mean()
  standard_error = (hi - lo) * np.sqrt(p * (1 - p) / n)
  assert abs(mean - x) < 5 * standard_error, (mean, x, p)


@pytest.mark.parametrize(
  "dtype_name,increment,ulp",
  [("bfloat16", 2.0**-12, 2.0**-7), ("float16", 2.0**-13, 2.0**-10)],
)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_small_updates_accumulate_only_when_stochastic(
  dtype_name, increment, ulp, rounding
):
  # x += increment (below half an ulp of 1.0) at every step: rounding to
  # nearest loses every update; stochastic rounding keeps them on average.
  assert increment < ulp / 2
  steps, rows, dim = 200, 1000, 8
  storage = RowStorage(dtype_name, rounding=rounding, seed=5)
  row_ids = tf.constant(np.arange(rows) + 2**36, tf.int64)
  stored = tf.cast(tf.ones([rows, dim]), storage.parameter_dtype)
  for step in range(steps):
    values = tf.cast(stored, tf.float32) + increment  # exact in float32
    stored = storage.encode(
      values, key=0, rows=row_ids, step=tf.constant(step, tf.int64)
    )
  final = tf.cast(stored, tf.float32).numpy().astype(np.float64)
  float32_final = 1.0
  for _ in range(steps):
    float32_final = float(np.float32(float32_final) + np.float32(increment))
  assert float32_final == 1.0 + steps * increment
  if rounding == "nearest":
    assert np.all(final == 1.0)
    return
  # Each rounding adds variance at most ulp**2 / 4 and no bias.
  bound = 5 * np.sqrt(steps) * (ulp / 2) / np.sqrt(final.size)
  assert bound < steps * increment / 10
  assert abs(final.mean() - float32_final) < bound, final.mean()


def _halfway(rng, dtype_name, shape):
  """float32 values halfway between two neighbours of the type (p = 0.5)."""
  values = oracle.type_values(dtype_name)
  values = values[np.abs(values) <= 6e4]
  lo = rng.choice(values[:-1], size=shape)
  hi = values[np.searchsorted(values, lo) + 1]
  return ((lo + hi) / 2).astype(np.float32)


@pytest.mark.parametrize("dtype_name", DTYPES16)
def test_stochastic_rounding_is_deterministic(rng, dtype_name):
  x = _halfway(rng, dtype_name, (512, 8))
  rows = _rows(rng, 512)

  def encode(seed=1, step=3, key=0, rows=rows, x=x):
    storage = RowStorage(dtype_name, slots=dtype_name, seed=seed)
    return _encode(storage, x, key=key, rows=rows, step=step)

  base = encode()
  _assert_same(encode(), base, x)
  # A row's draw does not depend on the other rows in the call, or order.
  order = rng.permutation(512)[:100]
  _assert_same(encode(rows=rows[order], x=x[order]), base[order], x[order])
  # At p = 0.5 another draw differs with probability 1/2.
  for other in (encode(seed=2), encode(step=4), encode(key=1), encode(key=2)):
    assert 0.4 < (other != base).mean() < 0.6


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("bad", [7e4, -7e4, 65504.5, 1e30])
def test_float16_refuses_values_beyond_its_range(rounding, bad):
  storage = RowStorage("float16", slots="float16", rounding=rounding)
  x = np.array([[1.0, 2.0], [bad, 3.0]], np.float32)
  for key in (0, 1):
    with pytest.raises(tf.errors.InvalidArgumentError, match="Table 't'"):
      _encode(storage, x, key=key, table="t")


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_float16_keeps_its_largest_value(rounding):
  x = np.array([[65504.0, -65504.0, 65500.0]], np.float32)
  got = _encode(RowStorage("float16", rounding=rounding), x)
  assert got[0, :2].tolist() == [65504.0, -65504.0]
  # 65500 lies between float16's 65472 and 65504, nearer the latter.
  want = {65504.0} if rounding == "nearest" else {65472.0, 65504.0}
  assert got[0, 2] in want


def test_float32_storage_returns_the_values_unchanged(rng):
  x = _varied(rng, "bfloat16", 4)
  x[0, 0] = 1e38
  for storage, key in [
    (RowStorage(), 0),
    (RowStorage(), 1),
    (RowStorage("float32", rounding="nearest"), 0),
    (RowStorage("bfloat16"), 1),  # the slots stay float32
    (RowStorage("float16"), 2),
    (RowStorage("float32", slots="bfloat16"), 0),
  ]:
    got = _encode(storage, x, key=key, step=1)
    np.testing.assert_array_equal(
      got.astype(np.float32).view(np.uint32), x.view(np.uint32)
    )


def test_row_storage_accepts_dtypes():
  storage = RowStorage(
    tf.bfloat16, slots=tf.float16, rounding="nearest", seed=-3
  )
  assert storage.parameter_dtype == tf.bfloat16
  assert storage.slot_dtype == tf.float16


@pytest.mark.parametrize(
  "kwargs,field",
  [
    ({"dtype": "float64"}, "dtype"),
    ({"dtype": tf.float64}, "dtype"),
    ({"dtype": "int8"}, "dtype"),
    ({"slots": "float8"}, "slots"),
    ({"slots": tf.int32}, "slots"),
    ({"rounding": "up"}, "rounding"),
    ({"rounding": None}, "rounding"),
    ({"seed": 1.5}, "seed"),
    ({"seed": True}, "seed"),
    ({"seed": "3"}, "seed"),
    ({"seed": None}, "seed"),
  ],
)
def test_row_storage_validation(kwargs, field):
  with pytest.raises(ValueError) as error:
    RowStorage(**kwargs)
  message = str(error.value)
  assert "\n" not in message
  assert message.startswith(f"RowStorage: {field} "), message
