"""The step scheduler: pure Python, no torch, no I/O, no awaits.

Each call to `schedule()` decides one denoising step: which batch key runs, which requests of that key advance
together in one forward (at most `max_batch`), which waiting requests are admitted, and which are dropped. The engine
turns the result into a `StepPlan`, every rank executes it, and `update_from_output()` records what happened.

Fairness: keys take turns weighted by the work each would run (smooth weighted round robin, as nginx balances
upstreams): a key whose forward would carry 7 requests gets 7 turns for every turn of a key with 1, so forwards stay
full, and every key with work gets its share of turns, so none starves. Ties go to the key with the oldest request.
(Plain alternation made 7 requests of one size and 1 of another take 55 forward-times for the seven instead of ~32.)
A busy key also never starves a lone request of another key of a running slot: while an older request of another key
waits, admissions of the running key leave one slot free for it.

Priority classes (issue 34): each request has a class, 0 to MAX_PRIORITY, higher served first. A key's class is the
highest effective class of its requests, and only keys of the highest class take turns (the round robin above runs
among them); waiting requests are admitted highest class first. Aging bounds the wait of a low class: its effective
class rises with the steps served to higher classes while it waits (engine/class_policy.py). Only keys of the top
class earn round-robin credit.

A forward carries only its key's top class: lower ones (running, or waiting for a free slot) sit out the step, and
join once aged into it; a request keeps the class it was admitted or advanced at (`floor`).

Deadlines: within a class, the waiting request whose client stops waiting first is admitted first (earliest deadline
first; requests without one after those with one).

Fair share across tenants: within a class and deadline, waiting requests are admitted in order of their tenant's
work served (denoising steps x pixels x frames) divided by its weight, least first (weighted fair queueing of
admissions). A tenant that starts asking is charged as much as the least-served tenant with work in flight, so
that idling earns no credit to spend later.

Preemption at step boundaries: when every running slot is taken and a waiting request of a higher class than some
running one would run now (its key is the one this step serves), the lowest-class running request (the newest of
them) is paused: the plan lists it in `pause`, every rank keeps its state (engine/parking.py moves a GPU's to host
memory) and it waits again, PREEMPTED, in the queue; admitted again, it is listed in `resume` and goes on from the
step it reached. At most as many are paused as this step admits, and at most `max_paused` are paused at once. A
request keeps the class it was admitted at (aging's included), so a request that aged its way in is not paused
again by the class it caught up with: the aging bound holds for paused requests too.

Short steps beside a higher class: for a while after a higher class was in flight, a lower class's steps carry
only the rows that fit in about one of its lone steps (engine/class_policy.py).

Admission in chunks: a step that advances running requests takes in only as many new ones as one step's time of
encoding their prompts allows (`costs`, measured by the engine; at least one), so a burst of arrivals never holds
the running requests for more than a step's worth of encoding; the rest join over the next steps. An idle key takes
in as many as it has room for (nothing waits on their encoding but themselves).

Decoding in pieces: a family whose decode comes in pieces (a Wan clip: a stage of a latent frame each) decodes a
finished request between steps. After its last step it leaves its running slot for `decoding` (unless that step's
pieces finished its decode) and ends (completed) when the executor reports its image. Each plan's `decode` names
whose pieces may run, in order: the requests finishing with the step and the decoding ones of the step's class or
above (as asked), highest class and oldest first; the executor runs pieces for about as long as the step's forward
took, so that an arriving request waits for about a step's worth of decoding, and a higher class for none of a
lower class's (aging lifts a decode's class as it lifts a step's). A decode of a class above all running and
waiting work runs in steps of its own, nothing else advancing or admitted, as its request's steps did (a step of
the class below would hold it up: measured on the tiny Wan, a class-9 frame's 8 ms decode spread over three flood
steps, one of them admitting two clips, 30-40 ms); the pieces of a lower class wait for the next step. While it
decodes, a request holds its running slot against its own class and below (as if it had decoded in its last
step), not against a higher class.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Hashable

from diffusiond.engine.class_policy import AGING_STEPS, CLASS_WINDOW_S, MAX_PRIORITY, Aging, ShortSteps
from diffusiond.engine.deadlines import AdmissionCosts
from diffusiond.engine.request import RequestStatus, SchedRequest, StepResult
from diffusiond.engine.wire import NewRequest, StepPlan


class QueueFullError(Exception):
    """The waiting queue is at `max_waiting`; the caller should retry later (HTTP 429)."""


class Scheduler:
    def __init__(
        self,
        *,
        max_batch: int,
        max_running: int | None = None,
        max_waiting: int = 256,
        gate: Callable[[SchedRequest, list[SchedRequest]], bool] | None = None,
        aging_steps: int = AGING_STEPS,
        preemption: bool = True,
        max_paused: int | None = None,
        class_window_s: float = CLASS_WINDOW_S,
        clock: Callable[[], float] = time.perf_counter,
        shares_calls: bool = False,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self.max_running = max_running if max_running is not None else max_batch
        if self.max_running < max_batch:
            raise ValueError(f"max_running ({self.max_running}) must be >= max_batch ({max_batch})")
        self.max_waiting = max_waiting
        self.waiting: deque[SchedRequest] = deque()
        self.running: dict[str, SchedRequest] = {}
        # Done with their steps, their decode going on in pieces (`_decode_pieces`): out of the running slots.
        self.decoding: dict[str, SchedRequest] = {}
        self._requests: dict[str, SchedRequest] = {}
        self._arrivals = itertools.count()
        self._step = 0
        self.aging = Aging(aging_steps)
        # Smooth weighted round robin: each step every candidate key earns its weight, the served key pays the total.
        self._credit: dict[Hashable, int] = {}
        self._pending_drop: list[str] = []
        # Whether a waiting request may join the running ones now (its LoRA adapters fit beside theirs); one that
        # may not stays waiting, and others of its key may go first.
        self.gate = gate
        # Work served per tenant (pixel-frame steps), for fair share.
        self.served: dict[str, float] = {}
        # Pause lower classes for higher ones (`--no-preemption` turns it off); at most `max_paused` at once.
        self.preemption = preemption
        self.max_paused = max_paused if max_paused is not None else self.max_running
        self.num_paused = 0
        # Measured admission costs (engine/deadlines.py): with them, a step that advances running requests takes in
        # only as many new ones as a step's time of encoding allows (paused ones coming back cost no encoding).
        self.costs: AdmissionCosts | None = None
        # Short steps beside a higher class (engine/class_policy.py), by the measured costs.
        self.short_steps = ShortSteps(class_window_s)
        self.clock = clock
        # Requests admitted in one step of a key share a computation (the generic path's calls): they advance, pause
        # and resume together, whole calls in a step even where a short step would carry fewer rows.
        self.shares_calls = shares_calls

    # ---- admission and cancellation (called between steps) ----

    def add(self, req: SchedRequest) -> None:
        if req.request_id in self._requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        # Bound everything in flight, not just the queue: requests that arrive together are all waiting until the
        # next schedule() moves some of them into free running slots.
        if len(self.waiting) + len(self.running) + len(self.decoding) >= self.max_waiting + self.max_running:
            raise QueueFullError(
                f"{len(self.waiting)} waiting and {len(self.running) + len(self.decoding)} running "
                f"(max_waiting={self.max_waiting}, max_running={self.max_running})"
            )
        if not 0 <= req.priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be 0 to {MAX_PRIORITY}, got {req.priority}")
        if req.weight <= 0:
            raise ValueError(f"weight must be above 0, got {req.weight}")
        if not any(r.tenant == req.tenant for r in self._requests.values()):
            # Back after idling: charged as the least-served tenant asking now (no credit saved up while idle).
            active = [self.served.get(r.tenant, 0.0) for r in self._requests.values()]
            self.served[req.tenant] = max(self.served.get(req.tenant, 0.0), min(active, default=0.0))
        req.status = RequestStatus.WAITING
        req.arrival = next(self._arrivals)
        self.aging.restart(req)
        self.waiting.append(req)
        self._requests[req.request_id] = req

    def effective_priority(self, req: SchedRequest) -> int:
        """Its class as aging has raised it (engine/class_policy.py), at least the class it ran at."""
        return self.aging.effective(req)

    def _admission_order(self) -> list[SchedRequest]:
        """Waiting requests, the next to admit first: highest effective class, then earliest deadline (none: last),
        then least-served tenant (by weight), then oldest."""
        return sorted(
            self.waiting,
            key=lambda r: (
                -self.effective_priority(r),
                math.inf if r.deadline is None else r.deadline,
                self.served.get(r.tenant, 0.0) / r.weight,
                r.arrival,
            ),
        )

    def cancel(self, request_id: str) -> SchedRequest | None:
        """Cancel a request. A waiting one finishes now (the returned request is FINISHED_CANCELLED); a running one
        is dropped by the next plan and finishes when `update_from_output` sees that plan. None if unknown/finished."""
        req = self._requests.get(request_id)
        if req is None or req.status.is_finished:
            return None
        if req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            if req.status == RequestStatus.PREEMPTED:  # every rank still holds its state
                self.num_paused -= 1
                self._pending_drop.append(request_id)
            self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_CANCELLED)
        else:
            req.cancel_requested = True
        return req

    def get(self, request_id: str) -> SchedRequest | None:
        return self._requests.get(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending_drop or self.decoding)

    # ---- one step ----

    def schedule(self) -> StepPlan:
        self.aging.ceiling_of(self._requests.values())
        now = self.clock()
        self.short_steps.seen(self._requests.values(), now)
        step = self._step
        self._step += 1
        drop = self._pending_drop
        self._pending_drop = []
        for slots in (self.running, self.decoding):
            for req in list(slots.values()):
                if req.cancel_requested:
                    drop.append(req.request_id)
                    del slots[req.request_id]

        # A decode of a class above all other work runs alone, as that request's steps did: nothing else steps.
        top_decode = max((self.aging.aged(r) for r in self.decoding.values()), default=-1)
        alone = top_decode > max(
            (self.effective_priority(r) for r in (*self.running.values(), *self.waiting)), default=-1
        )
        paused = self._preempt() if self.preemption and not alone else []
        advance: list[SchedRequest] = []
        new: list[NewRequest] = []
        resume: list[str] = []
        keys, total = ([], 0) if alone else self._keys_in_turn()
        for key in keys:
            group = sorted(
                (r for r in self.running.values() if r.key == key),
                key=lambda r: (-self.effective_priority(r), r.last_advanced, r.arrival),
            )
            # A forward carries only its key's top class (a lower one beside it would slow it down); lower classes
            # rise into it by aging. If the top class cannot run now (its admission is gated), the rest may.
            top = self._top_class(key, group)
            rows = self.short_steps.rows(self.costs, key, top, now, self.max_batch)
            advance = self._whole_calls([r for r in group if self.effective_priority(r) >= top][:rows], group)
            encodes = self.costs.new_per_step(key) if self.costs is not None and advance else None
            admitted = self._admit(key, rows - len(advance), top, encodes)
            if rows < self.max_batch and advance and not admitted and (later := self._admit(key, 1, top, encodes)):
                # A short step still lets a waiting request into a free slot, in place of a running one's turn.
                advance, admitted = advance[: rows - 1], later
            if not advance and not admitted:
                advance = self._whole_calls(group[:rows], group)
                admitted = self._admit(key, rows - len(advance))
            for req in admitted:
                advance.append(req)
                if not req.parked:
                    if self.shares_calls:
                        req.call = step
                    new.append(NewRequest(req.request_id, req.params))
                    continue
                req.parked = False
                if req.request_id in paused:  # paused and taken back by this very plan: it never left
                    paused.remove(req.request_id)
                    req.pauses -= 1
                else:
                    resume.append(req.request_id)
            if advance:
                self._credit[key] -= total
                break
        for req in advance:  # the class it ran at stays its own (aging's included)
            req.floor = max(req.floor, self.effective_priority(req))
            req.last_advanced = step
            self.aging.restart(req)
        decode = self._decode_pieces(advance, floor=top_decode if alone else None)
        served = (
            max(r.priority for r in self.decoding.values()) if alone else max((r.priority for r in advance), default=0)
        )
        self.aging.served(served)
        return StepPlan(
            step=step,
            new=new,
            advance=[r.request_id for r in advance],
            drop=drop,
            pause=paused,
            resume=resume,
            decode=decode,
        )

    def _decode_pieces(self, advance: list[SchedRequest], floor: int | None = None) -> list[str]:
        """Whose decode may run pieces this step, in the order they run (the executor runs pieces for about as
        long as the step's forward took, at least one): the requests finishing with it, and the decoding ones of
        the step's class or above (as asked), highest class first, oldest first within one. So a request arriving
        waits for about a step's worth of decoding, and a higher class's steps for none of a lower class's decode,
        which goes on when they are done or when aging lifts it (its class as asked: a decode is no step). In a
        step of decodes alone (`floor`: their class), only those of that class: a lower one's pieces after them
        would hold up their completion."""
        if floor is None:
            floor = min((r.priority for r in advance), default=0)
        eligible = [r for r in self.decoding.values() if self.aging.aged(r) >= floor]
        for req in eligible:
            self.aging.restart(req)
        eligible += [r for r in advance if r.steps_done + 1 >= r.total_steps]
        return [r.request_id for r in sorted(eligible, key=lambda r: (-r.priority, r.arrival))]

    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[SchedRequest]:
        """Record an executed plan; returns the requests that reached a terminal status with it."""
        finished: list[SchedRequest] = []
        for request_id, total in result.totals.items():
            if (req := self._requests.get(request_id)) is not None:
                req.total_steps = total
        for request_id in result.decoded:
            if (req := self.decoding.pop(request_id, None)) is not None and request_id not in result.failed:
                finished.append(self._finish(req, RequestStatus.FINISHED_COMPLETED))
        for request_id in plan.drop:
            req = self._requests.get(request_id)
            if req is not None and req.cancel_requested and not req.status.is_finished:
                finished.append(self._finish(req, RequestStatus.FINISHED_CANCELLED))
        for request_id, error in result.failed.items():
            req = self._requests.get(request_id)
            if req is None or req.status.is_finished:
                continue
            req.error = error
            self.running.pop(request_id, None)
            self.decoding.pop(request_id, None)
            # Other ranks may still hold its state: the next plan frees it everywhere.
            self._pending_drop.append(request_id)
            finished.append(self._finish(req, RequestStatus.FINISHED_FAILED))
        for request_id in result.advanced:
            req = self._requests.get(request_id)
            if req is None or req.status.is_finished:
                continue
            req.steps_done += 1
            self.served[req.tenant] = self.served.get(req.tenant, 0.0) + req.work
            if req.steps_done >= req.total_steps:
                self.running.pop(request_id, None)
                if request_id in result.decoding:
                    self.decoding[request_id] = req
                else:
                    finished.append(self._finish(req, RequestStatus.FINISHED_COMPLETED))
        return finished

    def fail_all(self, error: str) -> list[SchedRequest]:
        """Engine-level failure: every admitted request ends FINISHED_FAILED."""
        victims = [*self.waiting, *self.running.values(), *self.decoding.values()]
        self.waiting.clear()
        self.running.clear()
        self.decoding.clear()
        self.num_paused = 0
        for req in victims:
            req.error = error
            self._finish(req, RequestStatus.FINISHED_FAILED)
        return victims

    # ---- internals ----

    def _finish(self, req: SchedRequest, status: RequestStatus) -> SchedRequest:
        req.status = status
        del self._requests[req.request_id]
        return req

    def _candidates(self) -> dict[Hashable, tuple[int, int, int]]:
        """key -> (weight, oldest arrival, class) for every key that could run now. Weight: the requests its forward
        would carry (its running ones, plus waiting ones that fit into free slots), at most max_batch. Class: the
        highest effective class of those requests."""
        running: dict[Hashable, int] = {}
        oldest: dict[Hashable, int] = {}
        top: dict[Hashable, int] = {}
        for req in self.running.values():
            running[req.key] = running.get(req.key, 0) + 1
            oldest[req.key] = min(oldest.get(req.key, req.arrival), req.arrival)
            top[req.key] = max(top.get(req.key, 0), self.effective_priority(req))
        waiting: dict[Hashable, int] = {}
        free: dict[Hashable, int] = {}
        for req in self.waiting:
            if (room := self._free(req)) > 0:
                waiting[req.key] = waiting.get(req.key, 0) + 1
                free[req.key] = max(free.get(req.key, 0), room)
                oldest.setdefault(req.key, req.arrival)
                top[req.key] = max(top.get(req.key, 0), self.effective_priority(req))
        return {
            key: (
                min(self.max_batch, running.get(key, 0) + min(waiting.get(key, 0), free.get(key, 0))),
                first,
                top[key],
            )
            for key, first in oldest.items()
        }

    def _free(self, req: SchedRequest) -> int:
        """Running slots `req` may take: the free ones, less those that decoding requests of its class or above
        (as asked) still hold. A finished request holds its slot until its decode ends, as if it decoded in its
        last step, so that decodes do not pile up behind new admissions; a higher class takes the slot over."""
        held = sum(1 for r in self.decoding.values() if r.priority >= req.priority)
        return self.max_running - len(self.running) - held

    def _keys_in_turn(self) -> tuple[list[Hashable], int]:
        """Keys that could run now: the highest class first, within it the one with the most credit first (ties:
        the oldest request first); and the total weight that the served key pays back."""
        candidates = self._candidates()
        # Only the top class's keys take turns, so only they earn credit: a key that waited below (a flood while
        # an interactive class ran) would come up with turns saved for every step it could not run.
        top = max((rank for _, _, rank in candidates.values()), default=0)
        self._credit = {
            key: self._credit.get(key, 0) + (weight if rank == top else 0)
            for key, (weight, _, rank) in candidates.items()
        }
        total = sum(weight for weight, _, rank in candidates.values() if rank == top)
        ranked = sorted(candidates, key=lambda key: (-candidates[key][2], -self._credit[key], candidates[key][1]))
        return ranked, total

    def _preempt(self) -> list[str]:
        """Pause running requests of a lower class for the waiting ones of a higher class that this step would
        admit (the highest-ranked waiting key's, at most max_batch of them) and find no free running slot, unless a
        running request of a class above theirs takes the step; returns the ids paused (now PREEMPTED, back in the
        queue). Measured on the bundled model under a flood: a paused flood request that had aged in (its class
        kept) paused another flood request in each step a class-9 request ran alone, two pauses per arrival."""
        order = self._admission_order()
        if not order or self._free(order[0]) > 0:
            return []
        key = order[0].key
        heads = [r for r in order if r.key == key][: self.max_batch]
        paused: list[str] = []
        above = max((self.effective_priority(r) for r in self.running.values()), default=0)
        for head in heads:
            rank = self.effective_priority(head)
            # A higher class running takes this step: the head would not run now, and pausing for it is churn.
            if self._free(head) > 0 or self.num_paused >= self.max_paused or above > rank:
                break
            victims = [r for r in self.running.values() if not r.cancel_requested and self.effective_priority(r) < rank]
            if not victims:
                break
            victim = min(victims, key=lambda r: (self.effective_priority(r), -r.arrival))
            for req in self._whole_calls([victim], list(self.running.values())):  # a shared call pauses whole
                del self.running[req.request_id]
                req.status = RequestStatus.PREEMPTED
                req.pauses += 1
                req.parked = True
                self.aging.restart(req)  # its wait, for aging, starts now
                self.num_paused += 1
                self.waiting.append(req)
                paused.append(req.request_id)
            above = max(above, rank)  # this step's class now: a head below it would not run either
        return paused

    def _top_class(self, key: Hashable, group: list[SchedRequest]) -> int:
        """The highest effective class of a key's running requests, and of its waiting ones while a slot is free."""
        running = (self.effective_priority(r) for r in group)
        waiting = (self.effective_priority(r) for r in self.waiting if r.key == key and self._free(r) > 0)
        return max(*running, *waiting, 0)

    def _admit(self, key: Hashable, room: int, floor: int = 0, encodes: int | None = None) -> list[SchedRequest]:
        """Up to `room` waiting requests of `key` and class >= `floor`, of which at most `encodes` new (not paused)."""
        admitted: list[SchedRequest] = []
        new = 0
        order = self._admission_order()
        head = order[0] if order else None
        # Keep a slot for the next request of another key (older, or of a higher class), or a busy key would
        # starve it.
        reserve = 1 if head is not None and head.key != key else 0
        for req in order:
            if len(admitted) >= room:
                break
            if req in admitted:  # a call-mate of a paused call admitted before it
                continue
            if req.key != key or self.effective_priority(req) < floor or self._free(req) <= reserve:
                continue
            if encodes is not None and not req.parked and new >= encodes:
                continue
            # Paused requests keep their adapters resident: they count as running for the gate.
            held = [*self.running.values(), *(r for r in self.waiting if r.parked)]
            if self.gate is not None and not self.gate(req, held):
                continue
            mates = self._whole_calls([req], list(self.waiting)) if req.parked else [req]
            for mate in mates:  # a paused shared call resumes whole
                if mate in admitted:
                    continue
                self.waiting.remove(mate)
                if mate.status == RequestStatus.PREEMPTED:
                    self.num_paused -= 1
                mate.status = RequestStatus.RUNNING
                mate.floor = max(mate.floor, self.effective_priority(mate))
                self.running[mate.request_id] = mate
                admitted.append(mate)
            new += not req.parked
        return admitted

    def _whole_calls(self, chosen: list[SchedRequest], among: list[SchedRequest]) -> list[SchedRequest]:
        """`chosen` with every request of `among` that shares a call with one of them, in `among`'s order (chosen
        ones not in `among` first). Without shared calls, `chosen`."""
        if not self.shares_calls:
            return chosen
        calls = {r.call for r in chosen if r.call is not None}
        if not calls:
            return chosen
        ids = {r.request_id for r in chosen}
        extra = [r for r in among if r.request_id not in ids and r.call in calls]
        if not extra:
            return chosen
        keep = {r.request_id for r in extra} | ids
        ordered = [r for r in among if r.request_id in keep]
        return [r for r in chosen if r not in ordered] + ordered
