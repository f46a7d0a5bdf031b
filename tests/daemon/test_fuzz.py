"""Fuzzing the request decoders: no body a client can send gets past the edge unless it can also cross the wire and
run, and none makes the daemon answer 5xx.

Two layers:
- in-process, with hypothesis (derandomized, so CI sees the same inputs every run): the exact parsing and checking
  path of each route (`parse_*`, then `Engine.check`) on bodies mixing valid values with junk of every JSON type.
  Whatever passes must encode into a step plan and decode back unchanged; whatever fails must be a 4xx naming a field
  of the request (or none, for a body that is not an object).
- over a real socket, with a seeded generator: 1000 malformed requests against a live server, none answered 5xx,
  after which the server is healthy, idle and serving.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random

import aiohttp
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pictures import picture

from diffusiond.daemon.api import ApiError, GenerationRequest, ImageGenerationRequest, VideoCreateRequest
from diffusiond.daemon.app import request_limits
from diffusiond.daemon.config import ServeConfig
from diffusiond.daemon.native_api import parse_generation
from diffusiond.daemon.openai_api import expand, parse_image_generation
from diffusiond.daemon.video_requests import parse_video_create, resolve_video
from diffusiond.engine.engine import Engine
from diffusiond.engine.wire import NewRequest, StepPlan, decode_plan, encode_plan
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import ParamError
from diffusiond.models.tiny.lora import build_tiny_lora

EXAMPLES = 1500
HTTP_INPUTS = 1000
NATIVE_FIELDS = set(GenerationRequest.__struct_encode_fields__)  # as clients name them (`latents`)
OPENAI_FIELDS = set(ImageGenerationRequest.__struct_fields__)
VIDEO_FIELDS = set(VideoCreateRequest.__struct_fields__)

junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
# Per field: values the route accepts, values at or past its bounds, and junk of any JSON type. Valid values
# dominate, so that most bodies reach the deeper checks (the model, the limits, the wire) with one or two bad fields.
valid = {
    "prompt": st.sampled_from(["a red circle", "x", " a "]) | st.text(min_size=1, max_size=30),
    "negative_prompt": st.none() | st.text(max_size=20),
    "seed": st.integers(min_value=0, max_value=2**63 - 1),
    "width": st.sampled_from([16, 32, 48, 64]),
    "height": st.sampled_from([16, 32, 48, 64]),
    "num_inference_steps": st.integers(min_value=1, max_value=8),
    "guidance_scale": st.floats(min_value=0, max_value=100),
    "true_cfg_scale": st.floats(min_value=0, max_value=100),
    "guidance_scale_2": st.none() | st.floats(min_value=0, max_value=100),
    "preview_every": st.integers(min_value=0, max_value=8),
    "latents": st.booleans(),
    "preview": st.sampled_from(["fast", "vae"]),
    "cache_threshold": st.just(0.0) | st.none(),
    # (The fuzzed server runs without a cache: a mask is refused, naming the field.)
    "cache_steps": st.none() | st.sampled_from(["fast", "off"]) | st.lists(st.integers(0, 9), max_size=3),
    "skip_guidance_layers": st.none() | st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=3),
    "skip_layer_guidance_scale": st.floats(min_value=0, max_value=100),
    "skip_layer_guidance_start": st.floats(min_value=0, max_value=1),
    "skip_layer_guidance_stop": st.floats(min_value=0, max_value=1),
    "output_format": st.sampled_from(["png", "jpeg", "webp"]),
    "image": st.none() | st.just(base64.b64encode(picture(32, 48)).decode()) | st.just("aGVsbG8="),
    "strength": st.none() | st.floats(min_value=0, max_value=1),
    "mask": st.none() | st.just(base64.b64encode(picture(16, 16, mode="L")).decode()) | st.just("aGVsbG8="),
    "edit_context": st.none() | st.sampled_from(["preferred", "output"]),
    "reference_images": st.none() | st.just([base64.b64encode(picture(64, 64)).decode()]) | st.just(["aGk="]),
    # Audio-video guidance (LTX-2; others refuse them, naming the field).
    "audio_guidance_scale": st.none() | st.floats(min_value=0, max_value=100),
    "stg_scale": st.none() | st.floats(min_value=0, max_value=100),
    "audio_stg_scale": st.none() | st.floats(min_value=0, max_value=100),
    "modality_scale": st.none() | st.floats(min_value=0, max_value=100),
    "audio_modality_scale": st.none() | st.floats(min_value=0, max_value=100),
    "guidance_rescale": st.none() | st.floats(min_value=0, max_value=1),
    "audio_guidance_rescale": st.none() | st.floats(min_value=0, max_value=1),
    "stg_blocks": st.none() | st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=3),
    # Video fields (the image model refuses them, naming the field).
    "num_frames": st.none() | st.sampled_from([1, 5, 9]),
    "fps": st.none() | st.integers(min_value=1, max_value=240),
    "video_format": st.none() | st.sampled_from(["mp4", "webp"]),
    "audio_format": st.none() | st.sampled_from(["wav", "flac"]),
    "input_fidelity": st.sampled_from(["high", "low"]),
    "n": st.integers(min_value=1, max_value=10),
    "size": st.sampled_from(["64x64", "auto", "32x48"]),
    "stream": st.booleans(),
    "partial_images": st.integers(min_value=0, max_value=3),
    "output_compression": st.integers(min_value=0, max_value=100),
    "response_format": st.just("b64_json"),
    "priority": st.none() | st.integers(min_value=0, max_value=9),
    "deadline_ms": st.none() | st.integers(min_value=60_000, max_value=86_400_000),
    "quality": st.sampled_from(["auto", "low", "high"]),
    "background": st.sampled_from(["auto", "opaque"]),
    "moderation": st.sampled_from(["auto", "low"]),
    "style": st.sampled_from(["vivid", "natural"]),
    "user": st.text(max_size=10),
    "safety_identifier": st.text(max_size=10),
    "model": st.none(),
    "seconds": st.sampled_from(["1", "0.5", "2.25", 1, 7.5]),
    # Adapters the fuzzing engine registered ("a", "b"), one it did not, and scales within bounds.
    "lora": st.none()
    | st.just([])
    | st.lists(
        st.fixed_dictionaries(
            {"name": st.sampled_from(["a", "b", "nope"])}, optional={"scale": st.floats(min_value=-10, max_value=10)}
        ),
        min_size=1,
        max_size=2,
    ),
    # The generic path's further call arguments and images (a dedicated family refuses them, naming the field).
    "arguments": st.none()
    | st.just({})
    | st.dictionaries(
        st.sampled_from(["eta", "clip_skip", "Bad-Name"]), st.floats(0, 1) | st.integers(0, 3), max_size=2
    ),
    "images": st.none() | st.just({}) | st.just({"control_image": base64.b64encode(picture(32, 32)).decode()}),
    "input_reference": st.none()
    | st.just({"image_url": "data:image/png;base64," + base64.b64encode(picture(32, 48)).decode()})
    | st.just({"image_url": "https://example.com/a.png"}),
}
edge = (
    st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([-1, 0, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([-0.0, 1e-320, 100.00000000000001, 1e308, -1e308])
    | st.from_regex(r"\A\d{1,6}x\d{1,6}\Z")
    | st.integers(min_value=9_990, max_value=10_010).map(lambda n: "a" * n)
)


def weighted(*choices: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of the strategies, each drawn with its weight (st.one_of would treat repeated ones as one)."""
    return st.sampled_from([s for weight, s in choices for _ in range(weight)]).flatmap(lambda s: s)


def bodies(fields: set[str]) -> st.SearchStrategy[bytes]:
    value = {name: weighted((8, valid[name]), (1, edge), (1, junk)) for name in fields}
    optional = {k: v for k, v in value.items() if k != "prompt"}
    objects = st.fixed_dictionaries({"prompt": value["prompt"]}, optional=optional)
    unknown = st.dictionaries(st.sampled_from(["frobnicate", "PROMPT", ""]), junk, min_size=1, max_size=1)
    extra = weighted((4, st.just({})), (1, unknown))
    as_json = st.builds(lambda obj, more: json.dumps({**obj, **more}), objects, extra)
    # Not JSON objects, or not JSON at all (NaN and Infinity literals, truncations, any text).
    other = st.builds(json.dumps, junk) | st.text(max_size=30) | st.sampled_from(['{"prompt": "x", "seed": NaN}', "{"])
    text = weighted((6, as_json), (1, other))
    return text.map(lambda s: s.encode("utf-8", "replace"))


@pytest.fixture(scope="module")
def engine(tiny_sd3, tmp_path_factory):
    adapter = load_adapter(tiny_sd3)
    registry = adapter.enable_lora(1 << 30)
    for seed, name in enumerate("ab"):
        registry.register(
            name, str(build_tiny_lora(tiny_sd3, tmp_path_factory.mktemp("loras") / "x.safetensors", seed=seed))
        )
    # Not started: `check` needs only the adapter, the limits and the wire.
    return Engine(adapter, limits=request_limits(ServeConfig(), adapter.capabilities))


@pytest.fixture(scope="module")
def video_engine(tiny_wan):
    adapter = load_adapter(tiny_wan)
    return Engine(adapter, limits=request_limits(ServeConfig(), adapter.capabilities))


def assert_client_error(exc: ApiError, fields: set[str], data: bytes) -> None:
    """A 4xx that names one of the request's fields, or the unknown field it found, or none (not an object)."""
    assert 400 <= exc.status < 500, (exc.status, data)
    named = exc.param in fields | {None} or (exc.message.startswith("invalid request: Object contains unknown field"))
    assert named, (exc.param, exc.message, data)


def crosses_the_wire(params) -> None:
    plan = StepPlan(step=0, new=[NewRequest("fuzz", p) for p in params], advance=["fuzz"])
    assert decode_plan(encode_plan(plan)) == plan


@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=bodies(NATIVE_FIELDS))
def test_native_decoder(engine, data):
    try:
        _, params = parse_generation(data)
        resolved = engine.check(params)
    except ApiError as exc:
        assert_client_error(exc, NATIVE_FIELDS, data)
    except ParamError as exc:
        assert exc.param in NATIVE_FIELDS, (exc.param, data)
    else:
        crosses_the_wire([resolved])


@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=bodies(OPENAI_FIELDS))
def test_openai_decoder(engine, data):
    try:
        body, base = parse_image_generation(data, max_n=10)
        many = expand(engine, body, base)
    except ApiError as exc:
        assert_client_error(exc, OPENAI_FIELDS, data)
    except ParamError as exc:
        assert exc.param in OPENAI_FIELDS, (exc.param, data)
    else:
        assert len(many) == (body.n or 1)
        crosses_the_wire(many)


@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=bodies(VIDEO_FIELDS))
def test_video_decoder(video_engine, data):
    try:
        body, reference = parse_video_create(data)
        resolved = resolve_video(video_engine, body, reference)
    except ApiError as exc:
        assert_client_error(exc, VIDEO_FIELDS, data)
    except ParamError as exc:
        assert exc.param in VIDEO_FIELDS, (exc.param, data)
    else:
        assert resolved.num_frames is not None and resolved.fps is not None
        crosses_the_wire([resolved])


# ---- over the socket ----

GOOD = {"prompt": "a red circle", "size": "64x64", "num_inference_steps": 1, "seed": 1}
NATIVE_GOOD = {"prompt": "a red circle", "width": 64, "height": 64, "num_inference_steps": 1, "seed": 1}
JUNK_VALUES = [
    None, True, -1, 0, 2**63, 2**64, -(2**64), 10**30, 1e308, -1e-308, "", "x" * 300, "\u0000", "\ud800", [],
    [1, 2], {}, {"a": {"b": []}}, "64x64", "0x0", "99999x99999", 3.5,
]  # fmt: skip


def malformed(rng: random.Random) -> tuple[str, bytes, dict[str, str]]:
    """One malformed request: a route, raw body bytes and headers."""
    route, good = rng.choice([("/v1/images/generations", GOOD), ("/v1/generations", NATIVE_GOOD)])
    kind = rng.random()
    headers = {"Content-Type": "application/json"}
    if kind < 0.6:
        body = dict(good)
        fields = sorted((OPENAI_FIELDS if route.endswith("images/generations") else NATIVE_FIELDS) | {"zzz"})
        for _ in range(rng.randint(1, 3)):
            body[rng.choice(fields)] = rng.choice(JUNK_VALUES)
        text = json.dumps(body, ensure_ascii=rng.random() < 0.5)
        data = text.encode("utf-8", "surrogatepass")
    elif kind < 0.75:
        data = json.dumps(good).encode()[: rng.randint(0, 40)]  # truncated
    elif kind < 0.85:
        data = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))  # binary junk
    elif kind < 0.95:
        data = ("[" * rng.randint(1, 5000)).encode()  # deep nesting
    else:
        data = json.dumps(good).encode()
        headers = {"Content-Type": rng.choice(["text/plain", "application/x-www-form-urlencoded", "\u00ff"])}
    return route, data, headers


@pytest.mark.asyncio
async def test_a_thousand_malformed_requests_over_http(serve):
    # A server of its own whose limits keep the bodies that happen to be valid cheap to run.
    server = serve(max_steps=2, max_pixels=128 * 128, max_queue=64)
    rng = random.Random(20261129)
    cases = [malformed(rng) for _ in range(HTTP_INPUTS)]
    statuses: dict[int, int] = {}
    semaphore = asyncio.Semaphore(16)

    async def one(session, route, data, headers):
        async with semaphore, session.post(f"{server.base_url}{route}", data=data, headers=headers) as resp:
            text = await resp.read()
            statuses[resp.status] = statuses.get(resp.status, 0) + 1
            assert resp.status < 500, (resp.status, route, data[:200], text[:300])
            if resp.status >= 400:
                error = msgspec.json.decode(text)["error"]
                assert set(error) == {"message", "type", "param", "code"}, error

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(one(session, *case) for case in cases))
        print(f"{HTTP_INPUTS} malformed requests: statuses {dict(sorted(statuses.items()))}")
        await asyncio.to_thread(server.wait_idle)
        async with session.get(f"{server.base_url}/health") as resp:
            assert resp.status == 200
        async with session.post(f"{server.base_url}/v1/images/generations", json=GOOD) as resp:
            assert resp.status == 200
    assert server.state.engine.alive
    assert sum(statuses.values()) == HTTP_INPUTS and statuses.get(400, 0) > HTTP_INPUTS // 2


def test_an_integer_written_as_an_integral_float_is_that_integer():
    """`2.0` is an integer to JSON Schema (the OpenAPI document says integer) and what Python's json writes for a float
    2: taken as 2 wherever an integer is asked, nested ones too; a fraction, a string or a float past int64 is still
    refused naming its field, and a float field keeps its float."""
    from diffusiond.daemon.api import decode_body

    body = {"prompt": "a", "num_inference_steps": 2.0, "seed": 7.0, "guidance_scale": 2.0, "width": 64.0}
    native = decode_body(json.dumps(body).encode(), GenerationRequest)
    assert (native.num_inference_steps, native.seed, native.width) == (2, 7, 64)
    assert type(native.num_inference_steps) is int and type(native.guidance_scale) is float
    openai = decode_body(b'{"prompt": "a", "n": 2.0}', ImageGenerationRequest)
    assert openai.n == 2 and type(openai.n) is int
    for field, value in (("num_inference_steps", 2.5), ("num_inference_steps", "2"), ("seed", 1e300)):
        with pytest.raises(ApiError) as refused:
            decode_body(json.dumps({"prompt": "a", field: value}).encode(), GenerationRequest)
        assert refused.value.status == 400 and refused.value.param == field, (field, value)
    # A body that is not JSON past the float (typed decoding stops at the float): refused, never a server error.
    with pytest.raises(ApiError) as refused:
        decode_body(b'{"prompt": "a", "num_inference_steps": 2.5, "seed": ', GenerationRequest)
    assert refused.value.status == 400
    # A list of such floats is fixed at once (each fix decodes the body again, at most MAX_INTEGRAL_FIXES times):
    # 64 layer indices and 8 adapters' experts, beside every scalar integer, are taken; schemathesis sent the list.
    layers = [float(i) for i in range(64)]
    loras = [{"name": f"a{i}", "expert": 1.0} for i in range(8)]
    scalars = {"seed": 1.0, "num_inference_steps": 2.0, "width": 64.0, "height": 64.0, "preview_every": 1.0}
    body = {"prompt": "a", "skip_guidance_layers": layers, "lora": loras, "stg_blocks": [0.0, 1.0], **scalars}
    many = decode_body(json.dumps(body).encode(), GenerationRequest)
    assert many.skip_guidance_layers == tuple(range(64)) and {c.expert for c in many.lora} == {1}
