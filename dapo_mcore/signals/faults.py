"""Fault injection for the tests that prove a run survives kill -9 at an exact point (never set it otherwise).

``DAPO_MCORE_FAULT=POINT:ARG[:ARG...][@RANK]`` kills this process with SIGKILL when the code reaches that point with
those arguments (only the process whose job ``RANK`` is RANK, when given: one of several engine ranks). The points:

    publish:VERSION:BUCKET   trainer rank 0 (async mode), after sending bucket BUCKET of policy version VERSION
    generate:STEP            an engine rank (async mode), as it starts generating the batch of step STEP
    saved:STEP               a trainer rank, once the checkpoint of step STEP is complete on every rank
    step:STEP                a trainer rank, as it starts step STEP (``dapo-mcore rehearse`` kills one rank there)
    tool:CALL                an engine, inside its CALL-th tool call since the process began (multi-turn tool use)
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)

ENV = "DAPO_MCORE_FAULT"


def point(name: str, *args: int) -> None:
    """SIGKILL this process if ``DAPO_MCORE_FAULT`` names this point and these arguments."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    where, _, rank = spec.partition("@")
    if where == ":".join([name, *map(str, args)]) and rank in ("", os.environ.get("RANK")):
        log.warning("%s=%s: killing this process (SIGKILL)", ENV, spec)
        os.kill(os.getpid(), signal.SIGKILL)
