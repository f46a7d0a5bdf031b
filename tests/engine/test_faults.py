"""Rank 0 learns of another rank's fault even while its step thread hangs in a collective (as NCCL does: a peer's exit
does not break the collective before its timeout). Two processes with gloo cannot show this, since gloo fails the
collective as soon as the peer's socket closes; here a communicator that hangs stands in for NCCL."""

import asyncio
import threading
import time

import pytest

from diffusiond.engine.comm import LocalComm
from diffusiond.engine.engine import Engine
from diffusiond.engine.outputs import Failed
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import SamplingParams


class HangingComm(LocalComm):
    """Rank 0 of a world of two whose peers never answer the collectives inside the model."""

    world_size = 2

    def __init__(self) -> None:
        self.reported: str | None = None

    def report_fault(self, message: str) -> None:
        self.reported = message

    def fault(self) -> str | None:
        return self.reported


@pytest.mark.asyncio
async def test_a_reported_fault_ends_every_request_while_the_step_hangs(tiny_sd3, monkeypatch):
    adapter = load_adapter(tiny_sd3)
    in_collective, release = threading.Event(), threading.Event()

    def denoise(states):
        in_collective.set()
        release.wait(30)  # the collective that never completes
        raise RuntimeError("collective timed out")

    monkeypatch.setattr(adapter, "denoise", denoise)
    comm = HangingComm()
    engine = Engine(adapter, comm=comm, max_batch=1)  # "b" waits while "a" is in the step that hangs
    await engine.start()
    try:
        handles = [
            engine.add_request(SamplingParams(prompt=p, seed=1, width=64, height=64, num_inference_steps=5))
            for p in ("a", "b")
        ]
        assert await asyncio.to_thread(in_collective.wait, 10)
        t0 = time.monotonic()
        comm.report_fault("rank 1 failed while denoising")
        results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 5)
        elapsed = time.monotonic() - t0
        for handle, result in zip(handles, results, strict=True):
            assert isinstance(result, Failed), result
            assert "rank 1 failed while denoising" in result.error and handle.request_id in result.error
        assert elapsed < 2, elapsed
        # "a" was in the failing step (it may be its cause: a request that kills a rank must not be sent again
        # and kill the next group too); "b" never ran, so its client may send it again (daemon/handover.py).
        assert [r.retry for r in results] == [False, True], results
        assert not engine.alive and engine.fatal.is_set()
        # stop() does not wait for the stuck step thread.
        t0 = time.monotonic()
        await engine.stop()
        assert time.monotonic() - t0 < 5
    finally:
        release.set()
