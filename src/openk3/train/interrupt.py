"""Ctrl-C in `openk3 train` and `openk3 draft`: one line that says where the run stopped and what it saved (exit
code 130, openk3.cli), and renames that put a checkpoint in place are never stopped halfway."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from pathlib import Path


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run; the message says where it stopped and what was saved."""


def stopped_at(step: int, checkpoint: Path | None) -> Interrupted:
    saved = (f"the last checkpoint is {checkpoint} (resume with --resume {checkpoint})" if checkpoint
             else "no checkpoint was saved")
    return Interrupted(f"interrupted at step {step}; {saved}")


@contextmanager
def interrupts_held():
    """Ctrl-C waits until the block is done, then acts as it would have (outside the main thread: unchanged)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
    if caught and callable(previous):
        previous(signal.SIGINT, None)
