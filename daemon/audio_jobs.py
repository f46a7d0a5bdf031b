"""A sound model's jobs (Stable Audio Open's family; the generic path's audio pipelines: AudioLDM, ...): `POST
/v1/audio/generations` queues a job that runs whatever its client does, as a video's does (daemon/videos_api.py: the
same store, job database, leases and reruns after a restart), and its file is WAV (16-bit PCM) or FLAC. Reading,
listing and deleting them: daemon/jobs_api.py, under the same prefix.

`seconds` is the call's length argument where it takes one (Stable Audio's `audio_end_in_s`, AudioLDM's
`audio_length_in_s`); the job's `seconds` is then the file's real length."""

from __future__ import annotations

import uuid

from aiohttp import web

from diffusiond.daemon.api import ApiError, AudioCreateRequest, decode_body
from diffusiond.daemon.auth import TENANT
from diffusiond.daemon.edge import read_body
from diffusiond.daemon.idempotency import KEYS, fingerprint
from diffusiond.daemon.state import STATE
from diffusiond.daemon.video_store import VideoJob
from diffusiond.daemon.videos_api import admit_job, admit_once, check_job_model
from diffusiond.engine.engine import Engine
from diffusiond.models.params import SamplingParams

# The length arguments of the sound pipelines diffusers ships, in the order they are looked for.
LENGTH_ARGUMENTS = ("audio_end_in_s", "audio_length_in_s")


async def create_audio(request: web.Request) -> web.StreamResponse:
    data = await read_body(request, request.app[STATE].config.max_body_bytes)
    body = decode_body(data, AudioCreateRequest)
    digest = fingerprint(request.path, data)
    return await request.app[KEYS].once(request, request[TENANT], digest, lambda: _create(request, body, digest))


async def _create(request: web.Request, body: AudioCreateRequest, digest: str) -> web.Response:
    state = request.app[STATE]
    engine = state.require_engine()
    check_job_model(request, "audio", body.model)
    resolved = resolve_audio(engine, body)
    rid = uuid.uuid4().hex
    assert resolved.seed is not None
    job = VideoJob(
        id=f"audio_{rid}", request_id=rid, created_at=0, model=state.model_named(body.model), prompt=resolved.prompt,
        size="",
        seconds="" if body.seconds is None else f"{body.seconds:g}", num_frames=0, fps=0, seed=resolved.seed,
        audio_format=body.format,
    )  # fmt: skip
    cacheable = body.seed is not None

    def admit():
        return admit_job(request, job, resolved, body.priority, cacheable=cacheable, deadline_ms=body.deadline_ms)

    return await admit_once(request, digest, job.id, admit)


def resolve_audio(engine: Engine, body: AudioCreateRequest) -> SamplingParams:
    """The request the job runs, checked against the model and the limits (errors name the field sent)."""
    arguments = dict(body.arguments or {})
    if body.seconds is not None:
        caps = engine.adapter.capabilities
        fields = caps.fields or caps.call_arguments  # the generic path's, or a dedicated family's (Stable Audio's)
        name = next((n for n in LENGTH_ARGUMENTS if n in fields), None)
        if name is None:
            raise ApiError(400, "this model's call takes no length: leave seconds out", param="seconds")
        if name in arguments:
            raise ApiError(400, f"send seconds or arguments.{name}, not both", param="seconds")
        arguments[name] = body.seconds
    params = SamplingParams(
        prompt=body.prompt, negative_prompt=body.negative_prompt, seed=body.seed,
        num_inference_steps=body.num_inference_steps, guidance_scale=body.guidance_scale,
        arguments=arguments or None,
    )  # fmt: skip
    return engine.check(params)
