"""The correctness oracle: step-batched output equals diffusers' own pipeline `__call__`, per request.

Requests differ in prompt, seed, step count, guidance (and size, so two batch keys interleave), and arrive while
others are running, so they join a batch mid-flight. Float32 on CPU. Tolerance: max abs diff <= 1e-4 on the decoded
float image (measured: about 3e-6; batching changes only the order of float reductions).
"""

import asyncio

import diffusers
import numpy as np
import pytest
from caching import run_batch
from engines import reference, run_staggered

from diffusiond.engine.outputs import Completed
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import ParamError, SamplingParams

TOLERANCE = 1e-4

REQUESTS = {
    "sd3": [
        SamplingParams(prompt="a red circle", seed=1, width=64, height=64, num_inference_steps=6, guidance_scale=5.0),
        SamplingParams(
            prompt="a blue square on a white background",
            negative_prompt="blurry",
            seed=2,
            width=64,
            height=64,
            num_inference_steps=4,
            guidance_scale=3.0,
            preview_every=1,
        ),
        SamplingParams(
            prompt="a small green triangle", seed=3, width=64, height=64, num_inference_steps=5, guidance_scale=7.5
        ),
        SamplingParams(
            prompt="a photo of a cat", seed=4, width=96, height=64, num_inference_steps=3, guidance_scale=4.0
        ),
        SamplingParams(prompt="yellow dog", seed=5, width=64, height=64, num_inference_steps=3, guidance_scale=1.0),
    ],
    "flux": [
        SamplingParams(prompt="a red circle", seed=1, width=64, height=64, num_inference_steps=6, guidance_scale=3.5),
        SamplingParams(
            prompt="a blue square on a white background",
            seed=2,
            width=64,
            height=64,
            num_inference_steps=4,
            guidance_scale=1.5,
            preview_every=1,
        ),
        SamplingParams(
            prompt="a small green triangle", seed=3, width=64, height=64, num_inference_steps=5, guidance_scale=5.0
        ),
        SamplingParams(
            prompt="a photo of a cat", seed=4, width=96, height=64, num_inference_steps=3, guidance_scale=2.0
        ),
        SamplingParams(
            prompt="yellow dog",
            negative_prompt="blurry",
            seed=5,
            width=64,
            height=64,
            num_inference_steps=3,
            guidance_scale=3.5,
            true_cfg_scale=2.5,
        ),
        SamplingParams(
            prompt="white dog",
            negative_prompt="dark",
            seed=6,
            width=64,
            height=64,
            num_inference_steps=4,
            guidance_scale=3.5,
            true_cfg_scale=4.0,
        ),
    ],
    # SD3.5's layout; skip-layer guidance on some requests, in windows of their own, mixed with plain CFG ones.
    "sd35": [
        SamplingParams(
            prompt="a red circle",
            seed=1,
            width=64,
            height=64,
            num_inference_steps=6,
            guidance_scale=5.0,
            skip_guidance_layers=(1,),
            skip_layer_guidance_start=0.0,
            skip_layer_guidance_stop=0.7,
        ),
        SamplingParams(
            prompt="a blue square on a white background",
            negative_prompt="blurry",
            seed=2,
            width=64,
            height=64,
            num_inference_steps=4,
            guidance_scale=3.0,
            preview_every=1,
        ),
        SamplingParams(
            prompt="a small green triangle",
            seed=3,
            width=64,
            height=64,
            num_inference_steps=5,
            guidance_scale=7.5,
            skip_guidance_layers=(0, 1),
            skip_layer_guidance_scale=1.5,
            skip_layer_guidance_stop=0.9,
        ),
        SamplingParams(
            prompt="a photo of a cat",
            seed=4,
            width=96,
            height=64,
            num_inference_steps=3,
            guidance_scale=4.0,
            skip_guidance_layers=(1,),  # the pipeline's window (0.01, 0.2) of 3 steps holds none
        ),
        SamplingParams(
            prompt="yellow dog",
            seed=5,
            width=64,
            height=64,
            num_inference_steps=4,
            guidance_scale=4.0,
            skip_guidance_layers=(1,),
            skip_layer_guidance_stop=1.0,
        ),
    ],
    "z-image": [
        SamplingParams(prompt="a red circle", seed=1, width=64, height=64, num_inference_steps=6, guidance_scale=4.0),
        SamplingParams(
            prompt="a blue square on a white background with a tree",
            negative_prompt="blurry",
            seed=2,
            width=64,
            height=64,
            num_inference_steps=4,
            guidance_scale=2.5,
            preview_every=1,
        ),
        SamplingParams(prompt="green", seed=3, width=64, height=64, num_inference_steps=5, guidance_scale=6.0),
        SamplingParams(
            prompt="a photo of a cat", seed=4, width=96, height=64, num_inference_steps=3, guidance_scale=4.0
        ),
        # Guidance 0 is the Turbo checkpoints' setting: one row per request.
        SamplingParams(prompt="yellow dog", seed=5, width=64, height=64, num_inference_steps=3, guidance_scale=0.0),
        SamplingParams(prompt="white dog", seed=6, width=64, height=64, num_inference_steps=4, guidance_scale=0.0),
    ],
    # A UNet family stepped by its scheduler's own `step` per request (Euler here; more schedulers in test_sdxl.py).
    "sdxl": [
        SamplingParams(prompt="a red circle", seed=1, width=64, height=64, num_inference_steps=6, guidance_scale=5.0),
        SamplingParams(
            prompt="a blue square",
            negative_prompt="blurry",
            seed=2,
            width=64,
            height=64,
            num_inference_steps=4,
            guidance_scale=7.0,
            preview_every=1,
        ),
        # An explicit "" is encoded; no negative prompt is zeros (`force_zeros_for_empty_prompt`).
        SamplingParams(
            prompt="green", negative_prompt="", seed=3, width=64, height=64, num_inference_steps=5, guidance_scale=4.0
        ),
        # Latents of 9 x 7: the UNet's upsampling follows its skip connections' sizes.
        SamplingParams(
            prompt="a photo of a cat", seed=4, width=72, height=56, num_inference_steps=3, guidance_scale=3.0
        ),
        SamplingParams(prompt="yellow dog", seed=5, width=64, height=64, num_inference_steps=3, guidance_scale=1.0),
    ],
    # The pipeline's negative is always ""; a request's own negative prompt is handed to it as embeddings.
    "flux2-klein": [
        SamplingParams(prompt="a red circle", seed=1, width=64, height=64, num_inference_steps=6, guidance_scale=4.0),
        SamplingParams(
            prompt="a blue square",
            negative_prompt="blurry",
            seed=2,
            width=64,
            height=64,
            num_inference_steps=4,
            guidance_scale=6.0,
            preview_every=1,
        ),
        SamplingParams(prompt="green", seed=3, width=64, height=64, num_inference_steps=5, guidance_scale=3.0),
        SamplingParams(prompt="yellow dog", seed=5, width=64, height=64, num_inference_steps=3, guidance_scale=1.0),
        SamplingParams(prompt="white dog", seed=6, width=96, height=64, num_inference_steps=4, guidance_scale=1.0),
    ],
    # FLUX.2 [dev]: guidance-distilled, one row per request, each with its own embedded guidance.
    "flux2": [
        SamplingParams(prompt="a red circle", seed=1, width=64, height=64, num_inference_steps=6, guidance_scale=4.0),
        SamplingParams(
            prompt="a blue square on a white background",
            seed=2,
            width=64,
            height=64,
            num_inference_steps=4,
            guidance_scale=6.0,
            preview_every=1,
        ),
        SamplingParams(prompt="green", seed=3, width=64, height=64, num_inference_steps=5, guidance_scale=2.5),
        SamplingParams(prompt="yellow dog", seed=5, width=64, height=64, num_inference_steps=3, guidance_scale=1.0),
        SamplingParams(prompt="white dog", seed=6, width=64, height=64, num_inference_steps=4, guidance_scale=4.0),
    ],
    "qwen-image": [
        SamplingParams(
            prompt="a red circle",
            negative_prompt="blurry",
            seed=1,
            width=64,
            height=64,
            num_inference_steps=6,
            true_cfg_scale=4.0,
        ),
        SamplingParams(
            prompt="a blue square on a white background with a tree",
            negative_prompt="dark",
            seed=2,
            width=64,
            height=64,
            num_inference_steps=4,
            true_cfg_scale=2.5,
            preview_every=1,
        ),
        SamplingParams(
            prompt="green", negative_prompt="", seed=3, width=64, height=64, num_inference_steps=5, true_cfg_scale=6.0
        ),
        SamplingParams(
            prompt="a photo of a cat",
            negative_prompt="blurry",
            seed=4,
            width=96,
            height=64,
            num_inference_steps=3,
            true_cfg_scale=4.0,
        ),
        # No negative prompt: no true CFG, one row per request.
        SamplingParams(prompt="yellow dog", seed=5, width=64, height=64, num_inference_steps=3),
        SamplingParams(prompt="white dog on the grass", seed=6, width=64, height=64, num_inference_steps=4),
    ],
    # Qwen-Image 2.1: requests share a forward where their texts are of one length ("a red circle", "a red square").
    "qwen-image-21": [
        SamplingParams(
            prompt="a red circle",
            negative_prompt="blurry",
            seed=1,
            width=64,
            height=64,
            num_inference_steps=6,
            true_cfg_scale=4.0,
        ),
        SamplingParams(prompt="a red square", seed=2, width=64, height=64, num_inference_steps=4, preview_every=1),
        SamplingParams(
            prompt="a blue square on a white background", seed=3, width=64, height=64, num_inference_steps=5
        ),
        SamplingParams(prompt="a green box", seed=4, width=64, height=64, num_inference_steps=3),
        SamplingParams(
            prompt="yellow dog",
            negative_prompt="dark",
            seed=5,
            width=64,
            height=64,
            num_inference_steps=4,
            true_cfg_scale=2.5,
        ),
        SamplingParams(prompt="white dog", seed=6, width=96, height=64, num_inference_steps=4),
    ],
}


# A stochastic flow-matching scheduler (`stochastic_sampling`, as the bundled model ships): fresh noise at every
# step, drawn from each request's own generator.
REQUESTS["sd3-stochastic"] = REQUESTS["sd3"]
REQUESTS["ovis-image"] = [
    SamplingParams(prompt="a red circle", seed=1, width=64, height=64, num_inference_steps=6, guidance_scale=5.0),
    SamplingParams(
        prompt="a blue square on a white background",
        negative_prompt="blurry",
        seed=2,
        width=64,
        height=64,
        num_inference_steps=4,
        guidance_scale=3.0,
        preview_every=1,
    ),
    SamplingParams(prompt="green", seed=3, width=64, height=64, num_inference_steps=5, guidance_scale=6.0),
    SamplingParams(prompt="a photo of a cat", seed=4, width=96, height=64, num_inference_steps=3, guidance_scale=4.0),
    # Guidance 1: no negative branch (one row), as the pipeline's `do_classifier_free_guidance`.
    SamplingParams(prompt="a plain field", seed=5, width=64, height=64, num_inference_steps=3, guidance_scale=1.0),
]
# LongCat-Image rewrites each prompt by default (its text encoder generates a new one): a random encoder's rewrite does
# not depend on the prompt, so the requests whose prompt must matter here send the rewrite off. Renormalized CFG on,
# off and floored, in one batch.
NO_REWRITE = {"enable_prompt_rewrite": False}
REQUESTS["longcat-image"] = [
    SamplingParams(
        prompt="a red circle",
        seed=1,
        width=64,
        height=64,
        num_inference_steps=6,
        guidance_scale=5.0,
        arguments=NO_REWRITE,
    ),
    SamplingParams(
        prompt="a blue square on a white background",
        negative_prompt="blurry",
        seed=2,
        width=64,
        height=64,
        num_inference_steps=4,
        guidance_scale=3.0,
        preview_every=1,
        arguments={**NO_REWRITE, "enable_cfg_renorm": False},
    ),
    SamplingParams(prompt="green", seed=3, width=64, height=64, num_inference_steps=5, guidance_scale=6.0),
    SamplingParams(
        prompt="a photo of a cat",
        seed=4,
        width=64,
        height=64,
        num_inference_steps=3,
        guidance_scale=4.0,
        arguments={**NO_REWRITE, "cfg_renorm_min": 0.9},
    ),
    SamplingParams(prompt="a plain field", seed=5, width=96, height=64, num_inference_steps=3, guidance_scale=1.0),
]
# GLM-Image: the prior's tokens depend on prompt, size and seed; quoted text is read as glyphs, of a length per
# prompt (rows of one length share a call); guidance 1 runs one row.
REQUESTS["glm-image"] = [
    SamplingParams(prompt="a red circle", seed=1, width=64, height=64, num_inference_steps=6, guidance_scale=5.0),
    SamplingParams(
        prompt="a sign that says 'open' on a door",
        seed=2,
        width=64,
        height=64,
        num_inference_steps=4,
        guidance_scale=3.0,
        preview_every=1,
    ),
    SamplingParams(prompt='a "cat" and a "dog"', seed=3, width=64, height=64, num_inference_steps=5),
    SamplingParams(prompt="a photo of a cat", seed=4, width=96, height=64, num_inference_steps=3, guidance_scale=4.0),
    SamplingParams(prompt="a plain field", seed=5, width=64, height=64, num_inference_steps=3, guidance_scale=1.0),
]
# A checkpoint of a served class with another config (issue 52: a Qwen-Image-2512 layout is Qwen-Image's family's).
REQUESTS["qwen-image-other-layout"] = REQUESTS["qwen-image"]


FIXTURES = {
    "sd3": "tiny_sd3",
    "sd3-stochastic": "tiny_sd3_stochastic",
    "sd35": "tiny_sd35",
    "sdxl": "tiny_sdxl",
    "flux": "tiny_flux",
    "flux2-klein": "tiny_flux2klein",
    "flux2": "tiny_flux2",
    "z-image": "tiny_zimage",
    "ovis-image": "tiny_ovis",
    "longcat-image": "tiny_longcat",
    "qwen-image": "tiny_qwenimage",
    "qwen-image-other-layout": "tiny_qwenimage_other_layout",
    "qwen-image-21": "tiny_qwenimage21",
    "glm-image": "tiny_glm_image",
}


@pytest.mark.parametrize("family", list(FIXTURES))
def test_engine_matches_diffusers_pipeline(family, request):
    checkpoint = request.getfixturevalue(FIXTURES[family])
    adapter = load_adapter(checkpoint)
    handles, results, plans = asyncio.run(run_staggered(adapter, REQUESTS[family]))
    # SD3.5's layout is SD3's pipeline, and so is a stochastic scheduler's checkpoint.
    name, family = (
        family,
        {"sd35": "sd3", "sd3-stochastic": "sd3", "qwen-image-other-layout": "qwen-image"}.get(family, family),
    )
    assert adapter.family == family and type(adapter).__name__ != "GenericAdapter"  # its class's family serves it

    # Requests really joined running batches, and batches really mixed requests at different steps.
    joined = [p for p in plans if p.new and set(p.advance) - {n.request_id for n in p.new}]
    assert joined, "no request joined a running batch"
    assert max(len(p.advance) for p in plans) >= 3

    pipe = getattr(diffusers, adapter.pipeline_class).from_pretrained(checkpoint)
    pipe.set_progress_bar_config(disable=True)
    for handle, result in zip(handles, results, strict=True):
        assert isinstance(result, Completed), result
        expected = reference(pipe, family, handle.params)
        assert result.image.shape == expected.shape
        diff = float(np.abs(result.image - expected).max())
        print(f"{name} {handle.params.prompt!r}: max abs diff {diff:.2e}")
        assert diff <= TOLERANCE, f"{handle.params.prompt!r}: max abs diff {diff}"
    # Not vacuous: a different seed, prompt or guidance gives a clearly different image.
    first = _asdict(handles[0].params)
    for change in ({"seed": 99}, {"prompt": "a drawing of a blue dog"}, {"guidance_scale": 7.0, "true_cfg_scale": 7.0}):
        other = reference(pipe, family, SamplingParams(**{**first, **change}))
        assert float(np.abs(other - results[0].image).max()) > 100 * TOLERANCE, change
    if first.get("skip_guidance_layers"):  # and so does skip-layer guidance
        other = reference(pipe, family, SamplingParams(**{**first, "skip_guidance_layers": None}))
        assert float(np.abs(other - results[0].image).max()) > 100 * TOLERANCE


def _asdict(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in params.__struct_fields__}


def test_guidance_distilled_flux2_refuses_a_negative_prompt(tiny_flux2):
    """FLUX.2 [dev] has no negative branch: a negative prompt would change nothing, so it is a 400 naming the field,
    and /v1/models says the model takes none."""
    adapter = load_adapter(tiny_flux2)
    assert adapter.capabilities.guidance_styles == ("distilled",)
    assert adapter.capabilities.public()["negative_prompt"] is False
    with pytest.raises(ParamError) as info:
        adapter.resolve(SamplingParams(prompt="a cat", negative_prompt="blurry"))
    assert info.value.param == "negative_prompt"
    assert adapter.resolve(SamplingParams(prompt="a cat", guidance_scale=2.5)).guidance_scale == 2.5


def test_qwen_image_21_rows_of_one_text_length_share_a_forward(tiny_qwenimage21):
    """Qwen-Image 2.1 lays out every row of a call as its first (a padded prompt would move its image), so a step
    runs one call per text length: three requests whose prompts encode to one length, with true CFG and negatives of
    another, and a fourth with a longer prompt and the same negative, admitted together, make per step a call of
    the 3 positives, one of the 4 negatives and one of the long positive: not a call per row."""
    prompts = ["a red circle 1", "a red circle 2", "a red circle 3", "a blue square on a white background"]
    cfg = dict(negative_prompt="blurry", true_cfg_scale=4.0)
    calls = _rows_per_call(load_adapter(tiny_qwenimage21), prompts, **cfg)
    assert sorted(calls) == [1, 1, 3, 3, 4, 4], calls


def _rows_per_call(adapter, prompts: list[str], **cfg) -> list[int]:
    """The rows of each transformer call while `prompts` (64x64, 2 steps, `cfg`) run admitted together."""
    calls: list[int] = []
    hook = adapter.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(len(kwargs["hidden_states"])), with_kwargs=True
    )
    size = dict(width=64, height=64, num_inference_steps=2)
    try:
        run_batch(adapter, [SamplingParams(prompt=p, seed=i, **size, **cfg) for i, p in enumerate(prompts)])
    finally:
        hook.remove()
    return calls


def test_glm_image_rows_of_one_glyph_length_share_a_forward(tiny_glm_image):
    """GLM-Image's DiT takes no text mask (a padded glyph sequence would change the image), so a step runs one call
    per glyph length: three CFG requests whose prompts quote nothing (their glyphs: the empty text's, as every
    negative row's) and a fourth that quotes a word, admitted together, make per step one call of the 3 positives and
    4 negatives and one of the quoting positive: not a call per row or per request. A negative prompt is refused (the
    pipeline takes none), and /v1/models says so."""
    adapter = load_adapter(tiny_glm_image)
    assert adapter.capabilities.public()["negative_prompt"] is False
    with pytest.raises(ParamError) as info:
        adapter.resolve(SamplingParams(prompt="a cat", negative_prompt="blurry"))
    assert info.value.param == "negative_prompt"
    prompts = ["a red circle", "a blue square", "a cat", "a sign that says 'open'"]
    calls = _rows_per_call(adapter, prompts, guidance_scale=3.0)
    assert sorted(calls) == [1, 1, 7, 7], calls


def test_rgba_images_keep_their_alpha_except_in_jpeg():
    """Qwen-Image 2.1 decodes RGBA: PNG and WebP keep the alpha; JPEG, which has none, gets the image composited
    over white (a transparent red pixel is white, an opaque one red)."""
    import io

    from PIL import Image

    from diffusiond.daemon.image_encoding import encode_image

    image = np.zeros((32, 32, 4), dtype=np.float32)
    image[..., 0] = 1.0  # red
    image[:16, :, 3] = 1.0  # the top half opaque, the bottom transparent
    for fmt in ("png", "webp"):
        decoded = Image.open(io.BytesIO(encode_image(image, fmt, quality=100 if fmt == "webp" else None)))
        assert decoded.mode == "RGBA" and decoded.getpixel((8, 24))[3] == 0 and decoded.getpixel((8, 8))[3] == 255
    jpeg = np.asarray(Image.open(io.BytesIO(encode_image(image, "jpeg", quality=95))).convert("RGB"), dtype=int)
    assert np.abs(jpeg[8, 8] - [255, 0, 0]).max() < 16 and np.abs(jpeg[24, 8] - [255, 255, 255]).max() < 16
