"""Short steps beside a higher class (issue 34): for a window after a higher class was in flight, a lower class's
steps carry only the rows estimated to take about one lone step of that class, so that its next request waits about
that long for a step in progress. The scheduler alone, with a hand-driven clock and hand-recorded step times (no
torch). Broken on purpose once each: `_rows` returning `max_batch` always: the CPU-like tests went red (4 rows a
step after the class-9 request, not 1); short steps that admit no one beside a running request: red (the flood
request paused for the class-9 one never came back while the window was open); the budget without the lower class's
own lone step: red (one row a step where four cost little more than one)."""

from __future__ import annotations

import pytest

from diffusiond.engine.deadlines import AdmissionCosts
from diffusiond.engine.scheduler import SchedRequest, Scheduler, StepResult
from diffusiond.engine.wire import decode_plan, encode_plan
from diffusiond.models.params import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(rid: str, priority: int = 0, *, key="a", steps: int = 3) -> SchedRequest:
    params = SamplingParams(prompt=rid, seed=0, width=64, height=64, num_inference_steps=steps)
    return SchedRequest(request_id=rid, params=params, key=key, total_steps=steps, priority=priority)


def run_step(sched: Scheduler, clock: Clock, seconds: float = 0.013) -> list[str]:
    plan = decode_plan(encode_plan(sched.schedule()))
    sched.update_from_output(plan, StepResult(advanced=list(plan.advance)))
    clock.now += seconds
    return list(plan.advance)


def flooded(lone: float, full: float, window: float = 2.0, interactive_key="a") -> tuple[Scheduler, Clock]:
    """Four class-0 requests running in full steps; key "a" measured at `lone` seconds for one row and `full` for
    four (key "b", the interactive one when it differs, at `lone` for one); then a class-9 request ran to its end."""
    clock = Clock()
    sched = Scheduler(max_batch=4, class_window_s=window, clock=clock)
    sched.costs = AdmissionCosts()
    for i in range(4):
        sched.add(make(f"flood{i}", steps=100))
    assert len(run_step(sched, clock)) == 4
    sched.costs.record("a", full, 0, None, rows=4)
    sched.costs.record("a", lone, 0, None, rows=1)
    sched.costs.record("b", lone, 0, None, rows=1)
    assert len(run_step(sched, clock)) == 4  # no higher class yet: full steps
    sched.add(make("click", 9, key=interactive_key, steps=2))
    steps = [run_step(sched, clock) for _ in range(3)]
    assert ["click"] in steps  # it ran alone (its own class only), pausing a flood request for its slot
    for _ in range(3):
        if sched.num_running == 4:
            break
        run_step(sched, clock)  # the paused flood request comes back
    assert sched.num_running == 4 and not sched.num_waiting
    return sched, clock


@pytest.mark.parametrize("interactive_key", ["a", "b"])
def test_a_lower_class_steps_a_row_at_a_time_while_a_higher_class_is_active_on_a_cpu(interactive_key):
    """CPU-like: 4 rows take 4x one row's 13 ms. After the class-9 request, flood steps carry 1 row (13 ms fits its
    lone step, 26 ms does not), the four in turn; once the window has passed, 4 again. With the window off: 4."""
    sched, clock = flooded(lone=0.013, full=0.052, interactive_key=interactive_key)
    rows = [run_step(sched, clock) for _ in range(8)]
    assert all(len(r) == 1 for r in rows), rows
    assert {r[0] for r in rows[:4]} == {f"flood{i}" for i in range(4)}  # in turn, none left behind
    clock.now += 2.5  # the window has passed
    assert len(run_step(sched, clock)) == 4
    off, clock = flooded(lone=0.013, full=0.052, window=0)
    assert len(run_step(off, clock)) == 4


def test_a_full_batch_that_costs_a_lone_step_stays_full():
    """GPU-like: 4 rows take about one row's time, within the slack of the class-9 lone step: steps stay full."""
    sched, clock = flooded(lone=0.012, full=0.014)
    assert [len(run_step(sched, clock)) for _ in range(3)] == [4, 4, 4]


def test_no_row_is_held_back_where_rows_cost_little_beside_a_longer_lone_step():
    """The lower class's lone step (30 ms) is longer than the class-9 one (12 ms), and 4 of its rows take 33 ms:
    fewer rows would wait nearly as long and serve fewer, so steps stay full; at 4x its lone step, a row at a time."""
    sched, clock = flooded(lone=0.030, full=0.033, interactive_key="b")
    sched.costs.by_rows["b"].seconds[1] = 0.012
    assert [len(run_step(sched, clock)) for _ in range(3)] == [4, 4, 4]
    sched.costs.by_rows["a"].seconds[4] = 0.120
    assert [len(run_step(sched, clock)) for _ in range(3)] == [1, 1, 1]


def test_unmeasured_step_times_limit_nothing():
    clock = Clock()
    sched = Scheduler(max_batch=4, clock=clock)
    sched.costs = AdmissionCosts()
    for i in range(4):
        sched.add(make(f"flood{i}", steps=100))
    sched.add(make("click", 9, key="b", steps=1))
    assert run_step(sched, clock) == ["click"]
    assert len(run_step(sched, clock)) == 4  # nothing measured: no estimate to keep steps short by


def test_step_time_estimates_by_rows():
    costs = AdmissionCosts()
    assert costs.seconds("a", 1) is None and costs.rows_within("a", 1.0, 8) == 8
    costs.record("a", 0.040, 0, None, rows=4)
    assert costs.seconds("a", 4) == pytest.approx(0.040)
    assert costs.seconds("a", 2) == pytest.approx(0.020)  # from above: the per-row share
    assert costs.seconds("a", 6) == pytest.approx(0.060)  # from below: in proportion
    costs.record("a", 0.015, 0, None, rows=1)
    assert costs.seconds("a", 2) == pytest.approx(0.030)  # from the nearest count below
    assert costs.rows_within("a", 0.016, 8) == 1
    assert costs.rows_within("a", 0.045, 8) == 4  # 4 measured within; 2 and 3, estimated from 1, are not
    assert costs.rows_within("a", 0.001, 8) == 1  # at least one
