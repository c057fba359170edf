"""Several 2-worker MultiWorkerMirroredStrategy scripts in one cluster launch.

Launched by tests/backends/test_multi_worker.py on each worker
(``TF_CONFIG`` set): ``python mwms_phases.py DIR PHASE [PHASE ...]``.
Setting up a worker (importing TensorFlow, starting its server and the
collectives) costs more than most phases, so one launch runs several, one
after another, on one ``MultiWorkerMirroredStrategy``. Each phase is the
``main`` of its script in this directory, which asserts what its docstring
says and prints "OK" last:

* ``training``: ``mwms_training.py`` (checkpoints under ``DIR/training``);
* ``dynamic``: ``mwms_dynamic.py`` (``DIR/dynamic``);
* ``pipelining``: ``mwms_pipelining.py``;
* ``row_storage``: ``mwms_row_storage.py`` (``DIR/row_storage``);
* ``chunks:save``, ``chunks:restore``: ``mwms_checkpoint_chunks.py``
  (``DIR/chunks``; the restore in a later launch, of fresh workers);
* ``resume:full`` (``DIR/a``, whole values to ``DIR/full.npz``),
  ``resume:kill`` (``DIR/b``: both workers SIGKILL themselves, so it is a
  launch's last phase), ``resume:resumed`` (``DIR/b`` again, in a fresh
  launch, to ``DIR/resumed.npz``): ``mwms_resume.py``.

Before each phase a line ``=== PHASE`` (the test splits the output
there); output is flushed after each, so a phase's lines survive a later
SIGKILL. A failing phase ends the process (exit 1): the phases after it
do not run.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import mwms_checkpoint_chunks  # noqa: E402 (this directory)
import mwms_dynamic  # noqa: E402
import mwms_pipelining  # noqa: E402
import mwms_resume  # noqa: E402
import mwms_row_storage  # noqa: E402
import mwms_training  # noqa: E402
import tensorflow as tf  # noqa: E402


def phases(directory: str) -> dict:
  """Each phase's call, given the strategy."""
  path = lambda *parts: os.path.join(directory, *parts)  # noqa: E731
  chunks = path("chunks")
  return {
    "training": lambda s: mwms_training.main(path("training"), s),
    "dynamic": lambda s: mwms_dynamic.main(path("dynamic"), s),
    "pipelining": lambda s: mwms_pipelining.main(s),
    "row_storage": lambda s: mwms_row_storage.main(path("row_storage"), s),
    "chunks:save": lambda s: mwms_checkpoint_chunks.main("save", chunks, s),
    "chunks:restore": lambda s: mwms_checkpoint_chunks.main(
      "restore", chunks, s
    ),
    "resume:full": lambda s: mwms_resume.main(
      path("a"), "run", path("full.npz"), s
    ),
    "resume:kill": lambda s: mwms_resume.main(path("b"), "kill", "-", s),
    "resume:resumed": lambda s: mwms_resume.main(
      path("b"), "run", path("resumed.npz"), s
    ),
  }


def main(directory: str, names: list[str]) -> None:
  calls = phases(directory)
  unknown = sorted(set(names) - set(calls))
  assert not unknown, f"unknown phases {unknown}; one of {sorted(calls)}"
  for sub in ("training", "dynamic", "chunks", "row_storage"):
    os.makedirs(os.path.join(directory, sub), exist_ok=True)
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  for name in names:
    print(f"=== {name}", flush=True)
    calls[name](strategy)
    sys.stdout.flush()


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2:])
