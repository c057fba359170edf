"""The ranking trainer, SIGKILLed inside the save of one step.

``python disk_tier_kill.py STEP TRAINER_ARGS...`` runs
``model_garden.ranking.train`` with ``TRAINER_ARGS``; in the save of step
``STEP``, once the rows of the first variable of a table kept on disk are
written (the save's other variables and its index not yet), the process
kills itself with SIGKILL (tests/model_garden/test_disk_tier_kill.py).
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

from tpu_embedding.checkpointing import manager
from tpu_embedding.tables import tiered


def main() -> None:
  step, args = int(sys.argv[1]), sys.argv[2:]
  armed = []
  save = manager.CheckpointManager.save
  saved_parts = tiered._TieredVariable.saved_parts

  def saving(self, checkpoint_number=None, *rest, **options):
    if checkpoint_number == step:
      armed.append(step)
    return save(self, checkpoint_number, *rest, **options)

  def parts_then_kill(self, *rest, **options):
    yield from saved_parts(self, *rest, **options)
    if armed:
      print(f"killing this process in the save of step {step}", flush=True)
      os.kill(os.getpid(), signal.SIGKILL)

  manager.CheckpointManager.save = saving
  tiered._TieredVariable.saved_parts = parts_then_kill
  sys.argv = ["train", *args]
  runpy.run_module("model_garden.ranking.train", run_name="__main__")


if __name__ == "__main__":
  main()
