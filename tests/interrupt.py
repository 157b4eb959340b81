"""Interrupting a command-line run once it has logged: the SIGINT tests of train and train.family."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path


def interrupt_once_logged(proc: subprocess.Popen, metrics: Path, lines: int, wait: float) -> str:
    """SIGINT to ``proc`` once ``metrics`` holds ``lines`` lines (or ``wait`` seconds passed); its output."""
    deadline = time.monotonic() + wait
    while not (metrics.exists() and metrics.read_text().count("\n") >= lines) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    return proc.communicate(timeout=120)[0]
