"""Priority classes, aging and fair share in the scheduler alone (issue 34; no torch, hand-made step results).
Broken on purpose once: with aging removed (`effective_priority` returning the class as given), the aging test went
red (the class-0 request was never admitted while class 5 kept arriving)."""

from __future__ import annotations

import itertools

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


# ---- preemption (issue 34): pausing at step boundaries ----


def full_of_low(preemption: bool = True, **kwargs) -> Scheduler:
    """Two slots, both running: "low0" (class 0, one step done) and "low1" (class 1, one step done; the forward
    carries only the top class, so low0 waits beside it)."""
    sched = Scheduler(max_batch=2, max_running=2, aging_steps=1000, preemption=preemption, **kwargs)
    sched.add(make("low0", 0, steps=10))
    run_step(sched)
    sched.add(make("low1", 1, steps=10))
    assert run_step(sched)[0].advance == ["low1"]
    return sched


def test_a_higher_class_pauses_the_lowest_running_request_and_it_resumes_where_it_stopped():
    sched = full_of_low()
    sched.add(make("high", 5, steps=3))
    plan, _ = run_step(sched)
    assert plan.pause == ["low0"] and [n.request_id for n in plan.new] == ["high"]
    assert plan.advance == ["high"] and not plan.resume  # alone: low1, a lower class, waits a step
    assert sched.get("low0").steps_done == 1 and sched.num_paused == 1
    plans = [run_step(sched)[0] for _ in range(2)]  # "high" runs its last two steps
    assert all(p.advance == ["high"] for p in plans)
    plans = [run_step(sched)[0] for _ in range(9)]  # then low1 (class 1) to its end, before low0
    assert all(p.advance == ["low1"] and not p.resume for p in plans), plans
    plan, _ = run_step(sched)
    assert plan.resume == ["low0"] and plan.advance == ["low0"] and not plan.new  # its state, not a new one
    assert sched.get("low0").steps_done == 2 and sched.num_paused == 0
    while sched.has_work():
        run_step(sched)


def test_an_equal_class_waits_and_so_does_everyone_without_preemption():
    for sched, rid, priority in ((full_of_low(), "peer", 0), (full_of_low(preemption=False), "high", 5)):
        sched.add(make(rid, priority, steps=3))
        plan, _ = run_step(sched)
        assert not plan.pause and not plan.new, plan
        assert sched.get(rid).status.name == "WAITING"


def test_only_as_many_are_paused_as_this_step_admits():
    sched = full_of_low()
    sched.add(make("high", 5, steps=3))
    sched.add(make("other-key", 7, key="b", steps=3))  # the top class: its key runs this step, alone
    plan, _ = run_step(sched)
    assert plan.pause == ["low0"] and [n.request_id for n in plan.new] == ["other-key"]
    sched = full_of_low(max_paused=1)
    sched.add(make("h1", 5, steps=3))
    sched.add(make("h2", 5, steps=3))
    plan, _ = run_step(sched)
    assert plan.pause == ["low0"] and [n.request_id for n in plan.new] == ["h1"]  # max_paused=1: one pause


def test_no_pause_for_a_request_that_a_higher_class_keeps_from_this_step():
    """Every slot taken by class 0; class 9 and class 3 arrive: one class-0 request is paused for class 9, none for
    class 3 while class 9 takes the steps (class 3 would not run yet: pausing for it would move a request's state
    for nothing); class 3 takes class 9's slot when it is done. Broken on purpose once (the check removed): the
    other class-0 request was paused too, in class 9's second step."""
    sched = Scheduler(max_batch=2, max_running=2, aging_steps=10_000)
    sched.add(make("low0", 0, steps=50))
    sched.add(make("low1", 0, steps=50))
    run_step(sched)
    sched.add(make("urgent", 9, steps=3))
    sched.add(make("mid", 3, steps=5))
    plans = [run_step(sched)[0] for _ in range(3)]
    assert [(p.advance, p.pause) for p in plans] == [(["urgent"], ["low1"])] + [(["urgent"], [])] * 2
    plan, _ = run_step(sched)
    assert [n.request_id for n in plan.new] == ["mid"] and not plan.pause and sched.num_paused == 1


def test_a_paused_request_cancelled_ends_now_and_every_rank_frees_its_state():
    sched = full_of_low()
    sched.add(make("high", 5, steps=3))
    run_step(sched)
    cancelled = sched.cancel("low0")
    assert cancelled is not None and cancelled.status.name == "FINISHED_CANCELLED" and sched.num_paused == 0
    plan, _ = run_step(sched)
    assert plan.drop == ["low0"]


def test_a_request_that_aged_in_keeps_its_class_and_is_not_paused_again_by_it():
    """Aging's bound holds for pauses too: a class-0 request paused behind a stream of class-5 requests that never
    ends is admitted again within (5 + 1) * aging_steps steps, keeps the class it aged to, and the class-5 requests
    arriving after that wait for its slot instead of pausing it again."""
    sched = Scheduler(max_batch=1, max_running=1, aging_steps=2)
    sched.add(make("low", 0, steps=8))
    run_step(sched)
    sched.add(make("h0", 5, steps=1))
    plan, _ = run_step(sched)
    assert plan.pause == ["low"]
    resumed_at = None
    for step in range(1, 40):
        sched.add(make(f"h{step}", 5, steps=1))
        plan, _ = run_step(sched)
        if "low" in plan.resume:
            resumed_at = step
            break
    assert resumed_at is not None and resumed_at <= (5 + 1) * 2, resumed_at
    plans = []
    while "low" in sched._requests:
        sched.add(make(f"late{len(plans)}", 5, steps=1))
        plans.append(run_step(sched)[0])
    assert not any(p.pause for p in plans) and all(p.advance == ["low"] for p in plans), plans
    assert len(plans) == 8 - 2  # its two steps before the pause and at the resume counted once each


def test_a_forward_carries_only_its_key_s_top_class_until_aging_lifts_the_others():
    """Same key, free slots: a class-5 request runs alone (a class-0 one beside it would slow its forward down);
    the class-0 one, still running, shares the forward once aged to class 5 (aging_steps=3: 15 steps), and from
    then on (it keeps the class it ran at)."""
    sched = Scheduler(max_batch=4, max_running=4, aging_steps=3)
    sched.add(make("low", 0, steps=40))
    run_step(sched)
    sched.add(make("high", 5, steps=40))
    advanced = [run_step(sched)[0].advance for _ in range(20)]
    joined = [sorted(a) == ["high", "low"] for a in advanced]
    assert advanced[0] == ["high"] and joined.index(True) in range(13, 17), advanced
    assert all(joined[joined.index(True) :]), advanced


def decoding_step(sched: Scheduler, pieces_left: dict[str, int]):
    """A step whose executor decodes in pieces, with a budget of one piece: the first request its plan names that
    has pieces left runs one. A request finishing its steps has `pieces_left[id]` pieces. Returns the plan and the
    requests that ended."""
    plan = decode_plan(encode_plan(sched.schedule()))
    decoded = []
    for rid in plan.decode or []:
        if pieces_left[rid] > 0:
            pieces_left[rid] -= 1
            if pieces_left[rid] == 0 and rid in sched.decoding:
                decoded.append(rid)
            break
    ending = [rid for rid in plan.advance if (r := sched.get(rid)) and r.steps_done + 1 >= r.total_steps]
    result = StepResult(
        advanced=list(plan.advance), decoding=[rid for rid in ending if pieces_left[rid] > 0], decoded=decoded
    )
    return plan, sched.update_from_output(plan, result)


def ended_ids(ended) -> list[str]:
    return [r.request_id for r in ended]


def test_a_lower_class_decode_waits_for_a_higher_class_steps():
    """A class-0 clip finishes its steps with two pieces of decode left: it leaves its running slot (the class-9
    request waiting behind it is admitted at once), its pieces wait while class 9 steps, and run when nothing
    steps; it ends (completed) after its last piece, never before."""
    sched = Scheduler(max_batch=1, max_running=1, preemption=False)
    sched.add(make("clip", 0, steps=2))
    left = {"clip": 3, "urgent": 1}
    decoding_step(sched, left)
    sched.add(make("urgent", 9, steps=2))
    plan, ended = decoding_step(sched, left)  # the clip's last step and first piece: out of the slot, not done
    assert plan.advance == ["clip"] and plan.decode == ["clip"] and not ended
    assert "clip" in sched.decoding and sched.num_running == 0 and sched.has_work()
    plan, ended = decoding_step(sched, left)
    assert plan.advance == ["urgent"] and plan.decode == [] and not ended
    plan, ended = decoding_step(sched, left)
    assert plan.decode == ["urgent"] and ended_ids(ended) == ["urgent"]
    plan, ended = decoding_step(sched, left)
    assert plan.advance == [] and plan.decode == ["clip"] and not ended
    plan, ended = decoding_step(sched, left)
    assert plan.decode == ["clip"] and [(r.request_id, r.status.name) for r in ended] == [
        ("clip", "FINISHED_COMPLETED")
    ]
    assert not sched.has_work()


def test_aging_bounds_the_wait_of_a_lower_class_decode():
    """Class 5 keeps stepping: a class-0 decode still goes on, each time aging has lifted it to class 5 (within
    5 * aging_steps steps of the last time it could run)."""
    aging = 4
    sched = Scheduler(max_batch=1, max_running=1, aging_steps=aging, preemption=False)
    sched.add(make("clip", 0, steps=1))
    left = {"clip": 3, "busy": 1}
    decoding_step(sched, left)
    sched.add(make("busy", 5, steps=1000))
    pieces_at = [step for step in range(1, 20 * aging) if "clip" in (decoding_step(sched, left)[0].decode or [])]
    assert len(pieces_at) >= 2 and pieces_at[0] <= 6 * aging, pieces_at
    assert all(b - a <= 5 * aging + 1 for a, b in itertools.pairwise(pieces_at)), pieces_at
    assert "clip" not in sched.decoding  # its last piece ran: completed


def test_a_decoding_request_is_cancelled_or_failed_once():
    sched = Scheduler(max_batch=2)
    for rid in ("a", "b"):
        sched.add(make(rid, steps=1))
    left = {"a": 5, "b": 5}
    decoding_step(sched, left)
    assert set(sched.decoding) == {"a", "b"}
    sched.cancel("a")
    plan, ended = decoding_step(sched, left)
    assert plan.drop == ["a"] and [(r.request_id, r.status.name) for r in ended] == [("a", "FINISHED_CANCELLED")]
    assert ended_ids(sched.fail_all("engine stopped")) == ["b"] and not sched.has_work()


def test_decodes_run_highest_class_then_oldest_first():
    sched = Scheduler(max_batch=2, max_running=3)
    for rid in ("a", "b"):
        sched.add(make(rid, steps=1))
    left = {"a": 2, "b": 2, "c": 1}
    plan, _ = decoding_step(sched, left)
    assert plan.decode == ["a", "b"]  # their last step: the executor starts with the oldest
    sched.add(make("c", 5, steps=1))
    plan, ended = decoding_step(sched, left)
    assert plan.advance == ["c"] and plan.decode == ["c"] and ended_ids(ended) == ["c"]  # class 0 waits
    plan, ended = decoding_step(sched, left)
    assert plan.advance == [] and plan.decode == ["a", "b"] and ended_ids(ended) == ["a"]
    plan, ended = decoding_step(sched, left)
    assert plan.decode == ["b"] and not ended
    plan, ended = decoding_step(sched, left)
    assert ended_ids(ended) == ["b"] and not sched.has_work()


def test_a_higher_class_decode_runs_alone():
    """A class-9 frame finishes its steps with three pieces of decode left while class-0 clips run and wait: its
    pieces run in steps of their own, nothing advanced or admitted, until it ends; then class 0 goes on. Broken on
    purpose once (never alone): its pieces ran after class-0 forwards, one of them admitting the waiting clip.
    A decode of the same class as running work runs beside it (the flood's own decodes interleave with its steps)."""
    sched = Scheduler(max_batch=2, max_running=2, preemption=False, aging_steps=10_000)
    sched.add(make("clip", 0, steps=50))
    sched.add(make("short", 0, steps=1))
    left = {"clip": 1, "short": 10, "frame": 3, "queued": 1}
    decoding_step(sched, left)
    assert "short" in sched.decoding  # a class-0 decode with pieces left, beside the class-0 clip
    sched.add(make("frame", 9, steps=2))
    plan, _ = decoding_step(sched, left)
    assert plan.advance == ["frame"]  # a forward carries only its key's top class: the clip sits out
    sched.add(make("queued", 0, steps=50))
    plan, ended = decoding_step(sched, left)  # the frame's last step and first piece
    assert plan.advance == ["frame"] and plan.decode == ["frame"] and not ended
    plans = [decoding_step(sched, left) for _ in range(2)]
    # Alone: nothing advanced or admitted, and no piece of the class-0 decode after the frame's.
    assert [(p.advance, p.new, p.decode) for p, _ in plans] == [([], [], ["frame"])] * 2
    assert ended_ids(plans[-1][1]) == ["frame"]
    plan, _ = decoding_step(sched, left)
    assert plan.advance == ["clip"] and plan.decode == ["short"]  # "queued" waits for the slot "short" holds
    # A decode beside work of its own class: interleaved with its steps.
    sched = Scheduler(max_batch=2, max_running=2)
    sched.add(make("short", 0, steps=1))
    sched.add(make("long", 0, steps=50))
    left = {"short": 3, "long": 1}
    plans = [decoding_step(sched, left)[0] for _ in range(3)]
    assert [(p.advance, p.decode) for p in plans] == [(["short", "long"], ["short"])] + [(["long"], ["short"])] * 2


def test_a_decoding_request_holds_its_slot_against_its_class_not_a_higher_one():
    """As if it decoded in its last step: a class-0 request waits for the slot of a decoding class-0 one (no
    unbounded pile of decodes behind new admissions); a class-9 one takes it at once."""
    sched = Scheduler(max_batch=1, max_running=1, preemption=False)
    sched.add(make("clip", 0, steps=1))
    left = {"clip": 3, "next": 1, "urgent": 1}
    decoding_step(sched, left)
    sched.add(make("next", 0, steps=1))
    plan, _ = decoding_step(sched, left)
    assert plan.new == [] and plan.decode == ["clip"]
    sched.add(make("urgent", 9, steps=1))
    plan, ended = decoding_step(sched, left)
    assert [n.request_id for n in plan.new] == ["urgent"] and ended_ids(ended) == ["urgent"]
    plan, ended = decoding_step(sched, left)
    assert plan.new == [] and ended_ids(ended) == ["clip"]
    plan, _ = decoding_step(sched, left)
    assert [n.request_id for n in plan.new] == ["next"]


def test_a_key_that_waited_below_the_top_class_saved_no_turns():
    """A class-0 key sits out 50 steps of a class-5 key; when a class-5 request joins it, the two keys take turns.
    Broken on purpose once: with every candidate key earning credit, the waiting key came up with 50 steps of turns
    saved and took all 8 (an aged flood of clips held a class-9 request for 40 steps that way)."""
    sched = Scheduler(max_batch=1, max_running=4, aging_steps=10_000)
    sched.add(make("low", 0, key="small", steps=500))
    run_step(sched)
    sched.add(make("high", 5, key="big", steps=500))
    assert all(run_step(sched)[0].advance == ["high"] for _ in range(50))
    sched.add(make("peer", 5, key="small", steps=500))
    turns = [run_step(sched)[0].advance for _ in range(8)]
    assert 3 <= sum(a == ["high"] for a in turns) <= 5, turns


def test_a_wait_behind_its_own_class_ages_no_one():
    """Only steps served to a higher class age a waiting request: a class-0 request that waited 40 steps behind
    another class-0 one is still class 0, so the class-5 request waiting beside it goes first. Broken on purpose
    once: with every step counted, it had risen to class 5 and, older, went first (a flood's queue lifted it into
    the interactive class)."""
    sched = Scheduler(max_batch=1, max_running=1, aging_steps=5, preemption=False)
    sched.add(make("first", 0, steps=40))
    run_step(sched)
    sched.add(make("second", 0, steps=1))
    sched.add(make("vip", 5, key="b", steps=1))
    admitted = []
    while sched.has_work():
        plan, _ = run_step(sched)
        admitted += [n.request_id for n in plan.new]
    assert admitted == ["vip", "second"], admitted


def test_requests_that_share_a_call_advance_pause_and_resume_together():
    """The generic path's calls (`shares_calls`): the requests of a key admitted in one step share a call; a step
    advances whole calls (even where short steps would carry fewer rows), a higher class pauses a whole call and
    it resumes whole. Broken on purpose (`_whole_calls` returning what it is given): a pause took one request of the
    call of three, red."""
    sched = Scheduler(max_batch=4, max_running=4, shares_calls=True)
    for rid in ("a", "b", "c"):
        sched.add(make(rid, 0, steps=10))
    plan, _ = run_step(sched)
    assert plan.advance == ["a", "b", "c"]
    calls = {sched.get(rid).call for rid in "abc"}
    assert len(calls) == 1 and None not in calls
    sched.add(make("d", 0, steps=10))  # joins later: a call of its own
    plan, _ = run_step(sched)
    assert sorted(plan.advance) == ["a", "b", "c", "d"] and sched.get("d").call not in calls
    for rid in ("h1", "h2"):  # two class-5 requests on a full house: pauses make room, a whole call each
        sched.add(make(rid, 5, steps=2))
    pauses, resumes = [], []
    for _ in range(12):
        plan, _ = run_step(sched)
        pauses += [set(plan.pause)] if plan.pause else []
        resumes += [set(plan.resume)] if plan.resume else []
    whole = [{"a", "b", "c"}, {"d"}, {"a", "b", "c", "d"}]  # a plan pauses (resumes) whole calls
    assert pauses and all(p in whole for p in pauses), pauses
    assert resumes and all(r in whole for r in resumes) and set().union(*resumes) == set().union(*pauses), resumes
    rows = Scheduler(max_batch=1, max_running=4, shares_calls=True)
    for rid in ("x", "y"):
        rows.add(make(rid, 0, steps=5))
    rows.max_batch = 2  # both admitted in one step...
    run_step(rows)
    rows.max_batch = 1  # ...then steps of one row: the call still advances whole
    assert sorted(run_step(rows)[0].advance) == ["x", "y"]
