"""Progress lines of long planning work: `[  12.3 s] step; best overhead ...`, at least every few seconds.

`Reporter(progress)` is a context manager. Each line goes to the logger "planner" at INFO, and, with
`progress=True`, to stderr (a callable `progress` receives the line instead). While the work runs, a heartbeat
thread repeats the latest state with the elapsed time whenever nothing was said for `every_s` seconds, so a single
long step (a trace, a CP-SAT run) never leaves the caller without news.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Callable

from solvers.progress import SearchState

log = logging.getLogger("planner")
EVERY_S = 4.0


class Reporter:
    def __init__(self, progress: bool | Callable[[str], None] = False, every_s: float = EVERY_S):
        self.sink = progress if callable(progress) else (_to_stderr if progress else None)
        self.every_s = every_s
        self.t0 = time.perf_counter()
        self.latest = "starting"
        self.last_said = self.t0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return self.sink is not None or log.isEnabledFor(logging.INFO)

    def __call__(self, message: str) -> None:
        """Say `message` now (it becomes the state the heartbeat repeats)."""
        with self._lock:
            self.latest = message
            self._emit(message)

    def search(self, state: SearchState) -> None:
        """A solver's report (solvers.progress): the step running, the best overhead so far, the bound, the gap."""
        self(f"solving: {state.describe()}")

    def _emit(self, message: str) -> None:
        now = time.perf_counter()
        self.last_said = now
        line = f"[{now - self.t0:6.1f} s] {message}"
        log.info(line)
        if self.sink is not None:
            self.sink(line)

    def _beat(self) -> None:
        while not self._stop.wait(0.25):
            with self._lock:
                if time.perf_counter() - self.last_said >= self.every_s:
                    self._emit(f"{self.latest} (still running)")

    def __enter__(self) -> "Reporter":
        if self.active:
            self._thread = threading.Thread(target=self._beat, name="planner-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
