"""Request status and sampling parameters: plain data shared by the scheduler, the wire and the executor."""

from __future__ import annotations

import enum

import msgspec


class RequestStatus(enum.IntEnum):
    """Ordered so that `status.is_finished` is one comparison (as vLLM's `v1/request.py`)."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_COMPLETED = 3
    FINISHED_CANCELLED = 4
    FINISHED_FAILED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_COMPLETED


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, array_like=True, gc=False):
    """Everything that decides a request's image. Fully resolved before it reaches the wire: every rank must compute
    the same thing from it, so `None` never means "pick something" past `ModelAdapter.resolve`.

    `guidance_scale` is the family's main guidance knob (classifier-free guidance for SD3, the distilled guidance
    embedding for FLUX); `true_cfg_scale` is FLUX's optional real CFG, used with a negative prompt.
    """

    prompt: str
    negative_prompt: str | None = None
    seed: int | None = None
    width: int | None = None
    height: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    # Emit a preview every K steps (0: never). Previews never change the final image.
    preview_every: int = 0
    # With each preview, also hand out the raw latent.
    stream_latents: bool = False
