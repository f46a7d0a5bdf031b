"""The step loop of ranks other than 0: receive each plan's bytes, execute the same plan, until SHUTDOWN.

Followers keep the same request states as rank 0 (identical plans, explicit seeds) and join the collectives that a
parallel strategy runs inside the model. They neither decode images nor emit anything. An error fatal to the group
is reported to rank 0 through the fault board before it propagates (the caller exits, the agent restarts the group).
"""

from __future__ import annotations

import logging

from diffusiond.engine.comm import Communicator
from diffusiond.engine.executor import Executor
from diffusiond.engine.failures import FATAL, GroupFault
from diffusiond.engine.memory import Trimmer
from diffusiond.engine.parking import PAUSED_BYTES
from diffusiond.engine.wire import PlanKind, decode_plan
from diffusiond.models.base import ModelAdapter

log = logging.getLogger(__name__)


def run_follower(adapter: ModelAdapter, comm: Communicator, paused_bytes: int = PAUSED_BYTES) -> None:
    executor = Executor(adapter, comm=comm, driver=False)
    executor.parking.budget = paused_bytes
    trimmer = Trimmer()
    while True:
        try:
            plan = decode_plan(comm.broadcast(None))
            if plan.kind == PlanKind.SHUTDOWN:
                log.info("rank %d: shutdown plan received", comm.rank)
                return
            if plan.kind == PlanKind.HEARTBEAT:  # rank 0 is idle
                trimmer.idle()
                continue
            executor.execute(plan)
            trimmer.stepped()
        except FATAL as exc:
            # The board's message reaches clients: which rank and stage, never exception text.
            comm.report_fault(str(exc) if isinstance(exc, GroupFault) else f"rank {comm.rank} lost its group")
            raise
        except Exception as exc:
            # Outside the per-request stages (a bug, a plan that does not decode): nothing can keep the ranks in
            # step any more.
            log.exception("rank %d: step loop failed", comm.rank)
            comm.report_fault(f"rank {comm.rank} failed in its step loop")
            raise RuntimeError(f"rank {comm.rank}: step loop failed: {type(exc).__name__}") from exc
