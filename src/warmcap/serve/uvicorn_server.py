"""uvicorn's server, ending with exit code 0 on SIGINT/SIGTERM (``warmup serve`` and ``warmup proxy``)."""

from __future__ import annotations

import signal
from types import FrameType

import uvicorn


class QuietExitServer(uvicorn.Server):
    """uvicorn's own handler records the signal and raises it again once shut down, so the process
    would die of it (exit -15 for SIGTERM); a stop signal handled here is a clean exit 0."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True
