"""Every field of OpenAI's image and video requests is honoured (the pixels or bytes change), refused (a 400 naming it,
saying why) or accepted without effect and documented so (docs/http-api.md), and an answer never echoes a value that
was not honoured (issue 54, item 3)."""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

from diffusiond.daemon.api import AudioCreateRequest, ImageEditRequest, ImageGenerationRequest, VideoCreateRequest

DOCS = Path(__file__).resolve().parents[2] / "docs" / "http-api.md"
PROMPT = "a red circle on a white background"

# What each OpenAI field of the routes does here; our own extensions (from `negative_prompt` on) are the native
# API's and are checked there. A field added to a request struct must be put in one of these.
HONOURED = {
    "prompt": "the image",
    "model": "served names (test_capabilities.py)",
    "n": "images per request (test_openai.py)",
    "size": "the image's size",
    "response_format": "b64_json or url (test_files.py)",
    "output_format": "png, jpeg, webp (below)",
    "output_compression": "jpeg and webp quality (below)",
    "quality": "step-cache presets (tests/models/test_quality.py)",
    "background": "alpha kept or composited (below)",
    "stream": "SSE (test_openai.py)",
    "partial_images": "previews (test_openai.py)",
    "seconds": "the clip's length (test_videos.py)",
    "input_reference": "the first frame (test_videos.py)",
}
REFUSED = {"style", "input_fidelity"}
NO_EFFECT = {"user", "safety_identifier", "moderation"}
OURS_FROM = "negative_prompt"  # the first of our extensions in every struct


def openai_fields(struct) -> list[str]:
    names = list(struct.__struct_fields__)
    ours = names.index(OURS_FROM) if OURS_FROM in names else len(names)
    return [n for n in names[:ours] if n not in ("strength", "edit_context")]  # (edits: ours, after input_fidelity)


def test_every_openai_field_is_honoured_refused_or_documented_without_effect():
    fields = {f for s in (ImageGenerationRequest, ImageEditRequest, VideoCreateRequest, AudioCreateRequest)
              for f in openai_fields(s)}  # fmt: skip
    assert fields - set(HONOURED) - REFUSED - NO_EFFECT == set()
    text = DOCS.read_text()
    match = re.search(r"Accepted without effect: (.*?)\.\s", text, re.S)
    assert match, "docs/http-api.md says nothing of the fields accepted without effect"
    assert {f for f in NO_EFFECT if f"`{f}`" in match.group(1)} == NO_EFFECT


def png(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def kwargs(model: str, **extra) -> dict:
    body = {"num_inference_steps": 4, "seed": 5, **extra.pop("extra_body", {})}
    return dict(model=model, prompt=PROMPT, size="64x64", response_format="b64_json", extra_body=body, **extra)


def test_fields_without_effect_change_nothing_and_refused_ones_name_themselves(server, model_id):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        plain = client.images.generate(**kwargs(model_id))
        assert plain.background == "opaque"  # an RGB model's images are
        base = np.asarray(png(plain.data[0].b64_json))
        for extra in (
            {"user": "u-1"},
            {"moderation": "auto"},
            {"moderation": "low"},
            {"extra_body": {"safety_identifier": "s-1"}},
            {"background": "opaque"},
            {"background": "auto"},
        ):
            got = client.images.generate(**kwargs(model_id, **extra))
            assert np.array_equal(np.asarray(png(got.data[0].b64_json)), base), extra
            assert got.background == "opaque", extra
        for extra, field in (({"style": "vivid"}, "style"), ({"background": "transparent"}, "background"),
                             ({"moderation": "none"}, "moderation")):  # fmt: skip
            with pytest.raises(openai.BadRequestError) as err:
                client.images.generate(**kwargs(model_id, **extra))
            assert err.value.body["param"] == field, (extra, err.value.body)
        # Honoured: the format and its compression change the bytes.
        webp = [client.images.generate(**kwargs(model_id, output_format="webp", output_compression=q)) for q in (5, 95)]
        data = [base64.b64decode(w.data[0].b64_json) for w in webp]
        assert all(d[8:12] == b"WEBP" for d in data) and data[0] != data[1]
        assert webp[0].output_format == "webp"


def test_transparent_background_on_a_model_that_draws_alpha(serve, tiny_qwenimage21):
    """Qwen-Image 2.1's VAE decodes RGBA: `auto` and `transparent` keep the alpha channel (the answer says
    "transparent"), `opaque` composites over white (and says "opaque"), JPEG cannot carry it (400 naming
    output_format)."""
    server = serve(model=tiny_qwenimage21, max_steps=None)
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        (model,) = client.models.list().data
        assert model.model_extra["diffusiond"]["alpha"] is True
        asked = ("auto", "transparent", "opaque")
        answers = {b: client.images.generate(**kwargs(model.id, background=b)) for b in asked}
        images = {b: png(a.data[0].b64_json) for b, a in answers.items()}
        assert {b: a.background for b, a in answers.items()} == {
            "auto": "transparent", "transparent": "transparent", "opaque": "opaque"
        }  # fmt: skip
        assert images["auto"].mode == images["transparent"].mode == "RGBA" and images["opaque"].mode == "RGB"
        rgba = np.asarray(images["transparent"]).astype(np.float64)
        assert rgba[..., 3].min() < 255  # an alpha that is not all opaque: something to keep
        alpha = rgba[..., 3:] / 255
        over_white = np.round(rgba[..., :3] * alpha + 255 * (1 - alpha))
        assert np.abs(np.asarray(images["opaque"]).astype(np.float64) - over_white).max() <= 1
        webp = client.images.generate(**kwargs(model.id, background="transparent", output_format="webp"))
        assert png(webp.data[0].b64_json).mode == "RGBA"
        with pytest.raises(openai.BadRequestError) as err:
            client.images.generate(**kwargs(model.id, background="transparent", output_format="jpeg"))
        assert err.value.body["param"] == "output_format"
        jpeg = client.images.generate(**kwargs(model.id, output_format="jpeg"))
        assert jpeg.background == "opaque"


def test_edit_fields_refused_by_name(server, model_id):
    from pictures import picture

    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        for field, value in (("input_fidelity", "high"), ("input_fidelity", "low"), ("style", "natural")):
            with pytest.raises(openai.BadRequestError) as err:
                client.images.edit(  # (the SDK's edit takes no style: a client sends it as an extra field)
                    model=model_id, prompt=PROMPT, image=("in.png", picture(64, 64), "image/png"),
                    extra_body={field: value},
                )  # fmt: skip
            assert err.value.body["param"] == field
