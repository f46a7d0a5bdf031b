"""Every message that crosses between ranks, and nothing else.

Only changes cross the wire (vLLM's NewRequestData / CachedRequestData split): a request's parameters once, when it
is admitted, then only ids. Latents never travel; every rank derives identical states from identical plans and seeds.
"""

from __future__ import annotations

import enum

import msgspec

from diffusiond.engine.request import SamplingParams


class PlanKind(enum.IntEnum):
    STEP = 0
    # Nothing to run: keeps idle followers out of collective timeouts.
    HEARTBEAT = 1
    # Every rank leaves its step loop after this plan, so no rank stays blocked in a collective.
    SHUTDOWN = 2


class NewRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    params: SamplingParams


class StepPlan(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    step: int
    kind: PlanKind = PlanKind.STEP
    # Admitted this step: prepare them (encode prompts, draw initial latents) before the forward.
    new: list[NewRequest] = []
    # Run one denoising step for these, in one batched forward, in this order.
    advance: list[str] = []
    # Free these (cancelled or failed) before anything else.
    drop: list[str] = []

    @property
    def is_empty(self) -> bool:
        return not (self.new or self.advance or self.drop)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StepPlan)


def encode_plan(plan: StepPlan) -> bytes:
    return _encoder.encode(plan)


def decode_plan(data: bytes | bytearray | memoryview) -> StepPlan:
    return _decoder.decode(data)
