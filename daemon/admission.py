"""What a request must pass to be queued, and its queueing: the class its tenant may ask for, the tenant's quotas, its
deadline against the engine's estimate, and the engine's capacity; a request's siblings (the `n` images of one
HTTP request) are queued together or not at all."""

from __future__ import annotations

from collections.abc import Sequence

from diffusiond.daemon.api import ApiError, retry_later
from diffusiond.daemon.startup import class_deadlines
from diffusiond.daemon.state import ServerState
from diffusiond.daemon.tenants import Tenant
from diffusiond.engine.engine import Engine, QueueFullError, RequestHandle
from diffusiond.models.params import SamplingParams


def queue_requests(
    engine: Engine,
    state: ServerState,
    params: list[SamplingParams],
    *,
    tenant: Tenant,
    progress: bool = True,
    checked: bool = False,
    ids: Sequence[str] | None = None,
    priority: int | None = None,
    cacheable: bool = False,
    deadline_ms: int | None = None,
) -> list[RequestHandle]:
    """`tenant`: who asks (its quotas are checked here; the requests are its own). `progress`: whether the client
    is sent a progress event every step (the native stream); without, the engine emits none and status comes from
    `Engine.steps_done`. `checked`: `params` are resolved and wire-checked already (`Engine.check`), so the engine
    queues them as they are. `ids`: the requests' ids (a stream carried over a heal keeps those its client was
    told), else new ones. `priority`: the class the client asked for (None: `--default-priority`, within the
    tenant's range). `cacheable`: the client chose the seed (the result cache may answer)."""
    chosen = resolve_priority(state, tenant, priority)
    if deadline_ms is None:
        deadline_ms = class_deadlines(state.config).get(chosen)
    if deadline_ms is not None:
        if not checked:  # resolved once, for the estimate and for the queue
            params, checked = [engine.check(p) for p in params], True
        check_deadline(engine, params, chosen, deadline_ms)
    if not engine.has_capacity(len(params)):
        raise QueueFullError(f"{engine.num_in_flight} requests in flight")
    check_quotas(state, tenant, len(params))
    handles = []
    try:
        for i, p in enumerate(params):
            handles.append(
                engine.add_request(
                    p, ids[i] if ids else None, checked=checked, progress=progress, priority=chosen,
                    tenant=tenant.name, weight=tenant.weight, cacheable=cacheable,
                    deadline_s=None if deadline_ms is None else deadline_ms / 1000,
                )
            )  # fmt: skip
            state.record(handles[-1], tenant.name)
    except Exception:
        for h in handles:
            h.cancel()
        raise
    return handles


def check_deadline(engine: Engine, resolved: list[SamplingParams], priority: int, deadline_ms: int) -> None:
    """429 naming `deadline_ms` when the engine estimates the (resolved) requests finish after it
    (engine/deadlines.py)."""
    estimates = [engine.estimate(p, priority) for p in resolved]
    if any(e is None for e in estimates):
        return  # nothing measured yet: no grounds to refuse
    worst = max(e for e in estimates if e is not None)
    if worst * 1000 > deadline_ms:
        per_step = engine.step_times.of(engine.adapter.batch_key(resolved[0])) or 0.0
        raise ApiError(
            429,
            f"deadline_ms {deadline_ms}: the server estimates {worst:.1f} s to finish (the steps in flight of this "
            f"class and above, and this request's, at {per_step:.3f} s per step); ask for a longer deadline, a "
            "lower cost, or retry later",
            type="rate_limit_error",
            param="deadline_ms",
            code="deadline_unmeetable",
        )


def resolve_priority(state: ServerState, tenant: Tenant, asked: int | None) -> int:
    """The class a request runs in: the one asked for, which must be in the tenant's range (403 naming `priority`
    otherwise), else `--default-priority` brought into that range."""
    low, high = tenant.priority
    if asked is None:
        return min(max(state.config.default_priority, low), high)
    if not low <= asked <= high:
        raise ApiError(
            403,
            f"priority {asked} is outside what tenant {tenant.name} may ask for ({low} to {high})",
            param="priority",
            code="priority_not_allowed",
        )
    return asked


def check_quotas(state: ServerState, tenant: Tenant, n: int) -> None:
    """429 naming the quota when `n` more requests would take `tenant` past its max_in_flight or max_queued."""
    if tenant.max_in_flight is None and tenant.max_queued is None:
        return
    in_flight, waiting = state.usage(tenant.name)
    for quota, used in (("max_in_flight", in_flight), ("max_queued", waiting)):
        limit = getattr(tenant, quota)
        if limit is not None and used + n > limit:
            raise quota_exceeded(state, tenant, quota, f"{used} of {limit} used, {n} more asked")


def quota_exceeded(state: ServerState, tenant: Tenant, quota: str, detail: str) -> ApiError:
    """A tenant's quota reached (counted): 429, the quota named in the message and as the code."""
    if state.metrics is not None:
        state.metrics.tenant_refusals.labels(tenant.name, quota).inc()
    return retry_later(f"tenant {tenant.name}: quota {quota} reached ({detail})", quota, status=429)
