"""What the GPU benchmarks share: running the test suite on the device they measure."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_tests(paths: list[str], log: str | None = None) -> dict:
    """Run pytest on ``paths`` here (compiled kernels), or read the log of a run made just before.

    ``passed`` is pytest's exit status, or for a log its summary line ("N passed", no failure or error).
    """
    if log:
        text, returncode = Path(log).read_text(), None
    else:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths],
                              cwd=ROOT, capture_output=True, text=True)
        text, returncode = proc.stdout + proc.stderr, proc.returncode
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(lines) if " passed" in ln or " failed" in ln or " error" in ln), "")
    passed = returncode == 0 if returncode is not None else (" passed" in summary and "failed" not in summary and "error" not in summary)
    return {"passed": passed, "summary": summary, "tail": "\n".join(lines[-30:])}
