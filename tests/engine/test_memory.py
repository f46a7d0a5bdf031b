"""Freed memory goes back to the system (engine/memory.py): once the step thread has had no work for a while (not at
once: the last answer is being encoded then), and every so often while it has.

Broken on purpose once each: without the step loop's call when it runs out of work, the engine test saw no trim;
with the Trimmer's call to malloc_trim removed, the schedule test saw none; trimming as soon as work ran out (the
idle delay ignored): both red."""

from __future__ import annotations

import asyncio

import pytest
from procs import rss

from diffusiond.engine.engine import Engine
from diffusiond.engine.memory import Trimmer
from diffusiond.engine.outputs import Completed
from diffusiond.kernels.host import malloc_trim
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_trims_when_idle_after_work_and_every_so_often_while_busy():
    calls, clock = [], Clock()
    trimmer = Trimmer(every_s=30, trim=lambda: calls.append(clock.now), clock=clock, idle_s=1.0)
    trimmer.idle()
    assert calls == [] and trimmer.idle_wait() is None  # nothing ran since the start
    for t in (1, 2, 3):
        clock.now = t
        trimmer.stepped()
    assert calls == []  # busy, and 30 s have not passed
    assert trimmer.idle_wait() == 1.0
    trimmer.idle()
    assert calls == []  # the work just ran out: not yet
    clock.now = 3.6
    assert trimmer.idle_wait() == pytest.approx(0.4)
    trimmer.idle()
    assert calls == []
    clock.now = 4.0
    trimmer.idle()
    trimmer.idle()
    assert calls == [4.0] and trimmer.idle_wait() is None  # once, a second after the work ran out
    for t in range(5, 70):
        clock.now = t
        trimmer.stepped()
    assert calls == [4.0, 34, 64]
    assert trimmer.trims == 3


def test_malloc_trim_gives_freed_memory_back():
    trim = malloc_trim()
    assert trim is not None  # glibc here
    blocks = [bytearray(100_000 + 17 * i) for i in range(3000)]  # ~330 MB from the heap, in pieces
    for i in range(0, len(blocks), 2):
        blocks[i] = None  # every other block: free memory between live blocks, which free() keeps
    before = rss()
    trim()
    assert before - rss() > 100 << 20, (before, rss())
    del blocks


@pytest.mark.asyncio
async def test_the_step_thread_trims_when_its_work_is_done(tiny_sd3):
    engine = Engine(load_adapter(tiny_sd3), max_batch=4)
    await engine.start()
    try:
        trimmer, calls = engine.step_loop.trimmer, []
        trimmer._trim = lambda: calls.append(malloc_trim()())
        trimmer.idle_s = 0.5
        handles = [engine.add_request(SamplingParams(prompt="a circle", seed=s, width=64, height=64)) for s in (1, 2)]
        for handle in handles:
            assert isinstance(await handle.result(), Completed)
        await asyncio.sleep(0.25)
        assert not calls, "a trim as soon as the work was done, beside the answers' encoding"
        for _ in range(300):  # the step thread, waiting for work, trims half a second after its last step
            if calls:
                break
            await asyncio.sleep(0.01)
        assert calls, "no trim after the work was done"
    finally:
        await engine.stop()
