"""Running pytest in a tf-keras subprocess and reading its report.

Keras is chosen once per process (``TF_USE_LEGACY_KERAS``), so tests that
need tf-keras run in a child pytest; this runs it and checks that it passed.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Sequence


def run_pytest_under_tf_keras(
  args: Sequence[str], cwd: pathlib.Path, report_dir: pathlib.Path
) -> tuple[ET.Element, str]:
  """Runs ``pytest args`` under tf-keras; asserts it passed.

  Returns:
    ``(testsuite element of its JUnit report, the tail of its output)``.
  """
  report = report_dir / "report.xml"
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "pytest",
      "-q",
      "-p",
      "no:cacheprovider",
      f"--junitxml={report}",
      *args,
    ],
    env={**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"},
    cwd=cwd,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  output = result.stdout[-8000:] + result.stderr[-3000:]
  assert result.returncode == 0, output
  suite = ET.parse(report).getroot().find("testsuite")
  assert suite is not None, output
  assert suite.get("failures") == suite.get("errors") == "0", output
  return suite, output
