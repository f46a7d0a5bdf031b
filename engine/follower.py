"""The step loop of ranks other than 0: receive each plan's bytes, execute the same plan, until SHUTDOWN.

Followers keep the same request states as rank 0 (identical plans, explicit seeds) and join the collectives that a
parallel strategy runs inside the model. They neither decode images nor emit anything.
"""

from __future__ import annotations

import logging

from diffusiond.engine.comm import Communicator
from diffusiond.engine.executor import Executor
from diffusiond.engine.wire import PlanKind, decode_plan
from diffusiond.models.base import ModelAdapter

log = logging.getLogger(__name__)


def run_follower(adapter: ModelAdapter, comm: Communicator) -> None:
    executor = Executor(adapter, driver=False)
    while True:
        plan = decode_plan(comm.broadcast(None))
        if plan.kind == PlanKind.SHUTDOWN:
            log.info("rank %d: shutdown plan received", comm.rank)
            return
        if plan.kind == PlanKind.HEARTBEAT:
            continue
        executor.execute(plan)
