"""Priority classes, aging and fair share in the scheduler alone (issue 34; no torch, hand-made step results).
Broken on purpose once: with aging removed (`effective_priority` returning the class as given), the aging test went
red (the class-0 request was never admitted while class 5 kept arriving)."""

from __future__ import annotations

import pytest

from diffusiond.engine.scheduler import MAX_PRIORITY, SchedRequest, Scheduler, StepResult
from diffusiond.engine.wire import decode_plan, encode_plan
from diffusiond.models.params import SamplingParams


def run_step(sched: Scheduler):
    plan = decode_plan(encode_plan(sched.schedule()))  # through the wire, as the engine does
    return plan, sched.update_from_output(plan, StepResult(advanced=list(plan.advance)))


def make(rid: str, priority: int = 0, *, key="a", steps: int = 3, tenant: str = "", weight: float = 1.0, size=64):
    params = SamplingParams(prompt=rid, seed=0, width=size, height=size, num_inference_steps=steps)
    return SchedRequest(
        request_id=rid, params=params, key=key, total_steps=steps, priority=priority, tenant=tenant, weight=weight
    )


def test_the_highest_class_is_admitted_first():
    sched = Scheduler(max_batch=1)
    for rid, priority in (("low", 0), ("mid", 3), ("high", 7), ("mid2", 3)):
        sched.add(make(rid, priority, steps=1))
    order = []
    while sched.has_work():
        plan, _ = run_step(sched)
        order += [n.request_id for n in plan.new]
    assert order == ["high", "mid", "mid2", "low"]  # by class, then by arrival


def test_a_higher_class_key_takes_the_turns():
    """Running requests of two keys: while the class-5 key has work, the class-0 key does not advance (no aging yet:
    its wait is shorter than aging_steps)."""
    sched = Scheduler(max_batch=2, max_running=4, aging_steps=100)
    sched.add(make("low", 0, key="small", steps=50))
    run_step(sched)
    sched.add(make("high", 5, key="big", steps=10))
    advanced = [run_step(sched)[0].advance for _ in range(10)]
    assert all(a == ["high"] for a in advanced), advanced
    assert run_step(sched)[0].advance == ["low"]  # "high" finished


@pytest.mark.parametrize("aging", [5, 20])
def test_aging_bounds_the_wait_of_a_low_class(aging):
    """A class-0 request behind a stream of class-5 requests that never ends: it is admitted within
    (5 - 0 + 1) * aging_steps steps (it rises to class 5 after 5 * aging_steps, then ties are broken by arrival, and
    it is the oldest)."""
    sched = Scheduler(max_batch=1, max_running=1, aging_steps=aging)
    sched.add(make("starved", 0, steps=1))
    for i in range(3):
        sched.add(make(f"h{i}", 5, steps=1))
    admitted_at = None
    for step in range(1, 40 * aging):
        plan, _ = run_step(sched)
        if any(n.request_id == "starved" for n in plan.new):
            admitted_at = step
            break
        sched.add(make(f"h{step + 3}", 5, steps=1))  # one more high-class request for each one served
    assert admitted_at is not None and 5 * aging <= admitted_at <= (5 + 1) * aging, admitted_at


def test_a_tenant_flooding_the_queue_gets_its_weight_and_no_more():
    """Two tenants of weight 1: "flood" queues 60 requests at once, "steady" keeps 2 waiting. Over the window while
    both have work waiting, each gets half of the work served (within 10%); at weights 3:1, three quarters."""
    for weights, share in (((1.0, 1.0), 0.5), ((1.0, 3.0), 0.75)):
        sched = Scheduler(max_batch=2, max_running=2)
        for i in range(60):
            sched.add(make(f"f{i}", tenant="flood", weight=weights[0], steps=4))
        n = 0
        served = {"flood": 0, "steady": 0}
        for _ in range(200):
            while sum(r.tenant == "steady" for r in sched.waiting) < 2:
                sched.add(make(f"s{n}", tenant="steady", weight=weights[1], steps=4))
                n += 1
            before = dict(sched.served)
            run_step(sched)
            for tenant in served:
                served[tenant] += sched.served.get(tenant, 0) - before.get(tenant, 0)
            if not any(r.tenant == "flood" for r in sched.waiting):
                break
        got = served["steady"] / (served["flood"] + served["steady"])
        assert abs(got - share) <= 0.1 * share, (weights, served)


def test_idling_earns_no_credit():
    """A tenant that comes back after others were served is charged as the least-served tenant with work in flight:
    it does not take every slot until it has caught up."""
    sched = Scheduler(max_batch=1, max_running=1)
    for i in range(20):
        sched.add(make(f"a{i}", tenant="a", steps=1))
    for _ in range(10):
        run_step(sched)
    for i in range(5):
        sched.add(make(f"b{i}", tenant="b", steps=1))
    admitted = [n.request_id for _ in range(6) for n in run_step(sched)[0].new]
    assert sum(r.startswith("a") for r in admitted) >= 2, admitted  # turns alternate, b does not sweep


def test_a_class_out_of_range_is_refused():
    sched = Scheduler(max_batch=1)
    with pytest.raises(ValueError, match="priority must be 0 to 9"):
        sched.add(make("x", MAX_PRIORITY + 1))


def test_the_earliest_deadline_goes_first_within_a_class():
    sched = Scheduler(max_batch=1)
    for rid, deadline, priority in (("none", None, 0), ("late", 30.0, 0), ("soon", 10.0, 0), ("high", None, 1)):
        req = make(rid, priority, steps=1)
        req.deadline = deadline
        sched.add(req)
    order = []
    while sched.has_work():
        plan, _ = run_step(sched)
        order += [n.request_id for n in plan.new]
    assert order == ["high", "soon", "late", "none"]  # the class first, then the deadline, none last


def test_an_estimate_counts_the_work_ahead_at_the_measured_step_time():
    from diffusiond.engine.deadlines import StepTimes, estimate_seconds

    times = StepTimes()
    assert estimate_seconds(times, "a", 10, [100], 4) is None  # nothing measured: no grounds to refuse
    times.record("a", 0.5)
    times.record("a", 1.5)  # a running average: 0.8 x 0.5 + 0.2 x 1.5
    assert times.of("a") == pytest.approx(0.7)
    assert times.of("b") == pytest.approx(0.7)  # a key not run yet: the slowest measured
    # 100 + 20 steps ahead, 4 to a forward: 30 forwards, then its own 10.
    assert estimate_seconds(times, "a", 10, [100, 20], 4) == pytest.approx(40 * 0.7)
