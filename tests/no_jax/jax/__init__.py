"""Hides JAX from the processes the tests start (``tests/conftest.py``).

JAX is installed only as the oracle of ``tests/fdo/test_fdo.py``
(jax-tpu-embedding). Where it is importable, importing TensorFlow imports
it too (``tensorflow.lite.python.util`` tries ``from jax import jit``):
about 1.3 s of CPU in each of the suite's ~150 processes, none of which
uses it. On ``PYTHONPATH`` ahead of site-packages, this package makes
``import jax`` fail as it does where JAX is not installed, as for most
users.
"""

raise ImportError(
  "JAX is hidden from the processes the tests start (tests/no_jax); "
  "only tests/fdo/test_fdo.py uses it, in the pytest process"
)
