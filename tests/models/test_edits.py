"""Image to image: step-batched edits equal diffusers' Img2Img pipelines `__call__`, per request.

Edit requests of different images, strengths, seeds, step counts and guidance join running batches, mixed with
text-to-image requests of the same size (they share forwards: the input image only changes where a request starts).
Float32 on CPU; tolerance as the text-to-image oracle (tests/models/test_parity.py): max abs diff <= 1e-4.
"""

import asyncio
import dataclasses

import diffusers
import msgspec
import numpy as np
import pytest
import torch
from engines import reference, run_staggered
from pictures import decoded, mask, picture

from diffusiond.engine.outputs import Completed
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.loading.pipelines import channels_last_vae
from diffusiond.models.params import ParamError, SamplingParams

TOLERANCE = 1e-4
IMAGES = [picture(80, 64, seed=1), picture(64, 64, seed=2, fmt="JPEG"), picture(48, 96, seed=3, mode="RGBA")]


def requests(family: str) -> list[SamplingParams]:
    """Five requests; each family's main guidance knob differs between them (Qwen-Image: true CFG, with a negative
    prompt on all but one)."""
    base = {"sd3": 5.0, "sdxl": 5.0, "flux": 3.5, "z-image": 4.0, "qwen-image": 4.0}[family]

    def guided(scale: float, negative: str | None = "blurry") -> dict:
        if family == "qwen-image":
            return {"negative_prompt": negative, "true_cfg_scale": scale} if negative else {}
        return {"guidance_scale": scale}

    return [
        SamplingParams(
            prompt="a red circle",
            image=IMAGES[0],
            strength=0.8,
            seed=1,
            width=64,
            height=64,
            num_inference_steps=8,
            **guided(base),
        ),
        SamplingParams(prompt="a blue square", seed=2, width=64, height=64, num_inference_steps=4, **guided(base)),
        SamplingParams(
            prompt="a small green triangle",
            image=IMAGES[1],
            strength=0.5,
            seed=3,
            width=64,
            height=64,
            num_inference_steps=6,
            preview_every=1,
            **guided(base + 1, "dark"),
        ),
        SamplingParams(
            prompt="a photo of a cat",
            image=IMAGES[2],
            seed=4,
            width=64,
            height=64,
            num_inference_steps=5,
            **guided(base - 1, None),
        ),  # the family's default strength (0.6)
        SamplingParams(
            prompt="yellow dog", image=IMAGES[0], strength=1.0, seed=5, width=64, height=64, num_inference_steps=3
        ),
    ]


def reference_edit(pipes, family: str, params: SamplingParams) -> np.ndarray:
    text_to_image, image_to_image = pipes
    if params.image is None:
        return reference(text_to_image, family, params)
    image = decoded(params.image)
    if family in ("z-image", "sdxl"):
        # ZImageImg2ImgPipeline and StableDiffusionXLImg2ImgPipeline encode the image at its own size (it is the
        # output's); every other Img2Img pipeline resizes it first with its image processor, as we do for all:
        # hand them that image.
        image = image_to_image.image_processor.resize(image, params.height, params.width)
    return reference(image_to_image, family, params, image=image, strength=params.strength)


FAMILIES = {
    "sd3": ("tiny_sd3", "StableDiffusion3Img2ImgPipeline"),
    "sdxl": ("tiny_sdxl", "StableDiffusionXLImg2ImgPipeline"),
    "flux": ("tiny_flux", "FluxImg2ImgPipeline"),
    "z-image": ("tiny_zimage", "ZImageImg2ImgPipeline"),
    "qwen-image": ("tiny_qwenimage", "QwenImageImg2ImgPipeline"),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_edits_match_diffusers_img2img(family, request):
    fixture, img2img = FAMILIES[family]
    checkpoint = request.getfixturevalue(fixture)
    adapter = load_adapter(checkpoint)
    sent = requests(family)
    handles, results, plans = asyncio.run(run_staggered(adapter, sent))
    joined = [p for p in plans if p.new and set(p.advance) - {n.request_id for n in p.new}]
    assert joined, "no request joined a running batch"
    assert max(len(p.advance) for p in plans) >= 3

    pipe = getattr(diffusers, adapter.pipeline_class).from_pretrained(checkpoint)
    pipes = (pipe, getattr(diffusers, img2img).from_pipe(pipe))
    for p in pipes:
        p.set_progress_bar_config(disable=True)
    for handle, result in zip(handles, results, strict=True):
        assert isinstance(result, Completed), result
        params = handle.params
        # The forwards the pipeline runs: with an image, the last `strength` of the schedule.
        forwards = sum(handle.request_id in p.advance for p in plans)
        assert forwards == params.steps_to_run
        if params.image is not None and params.strength < 1:
            assert forwards < params.num_inference_steps
        expected = reference_edit(pipes, family, params)
        diff = float(np.abs(result.image - expected).max())
        print(f"{family} {params.prompt!r} strength {params.strength}: max abs diff {diff:.2e}")
        assert diff <= TOLERANCE, f"{params.prompt!r}: max abs diff {diff}"
    # Not vacuous: another image or strength gives a clearly different image (10x the tolerance, 1000x the
    # measured differences: the tiny Qwen-Image VAE passes little of its input through, 0.009 at strength 0.8).
    first = handles[0].params
    for change in ({"image": IMAGES[1]}, {"strength": 0.65}):
        other = reference_edit(pipes, family, msgspec.structs.replace(first, **change))
        assert float(np.abs(other - results[0].image).max()) > 10 * TOLERANCE, change


def test_edit_requests_are_checked(tiny_sd3):
    adapter = load_adapter(tiny_sd3)

    def refused(**fields) -> str:
        with pytest.raises(ParamError) as info:
            adapter.resolve(SamplingParams(prompt="a dog", **fields))
        return info.value.param

    assert refused(image=b"not an image") == "image"
    assert refused(strength=0.5) == "strength"  # without an image
    assert refused(image=IMAGES[0], strength=0.0, num_inference_steps=10) == "strength"  # no step left
    assert refused(image=IMAGES[0], skip_guidance_layers=(1,)) == "skip_guidance_layers"
    assert refused(mask=MASKS[0][0]) == "mask"  # without an image
    assert refused(image=IMAGES[0], reference_images=(IMAGES[1],)) == "reference_images"  # one-image family
    assert refused(image=IMAGES[0], mask=b"not a mask") == "mask"
    truncated = picture(64, 64)[:200]
    from diffusiond.models.inputs import check_image

    with pytest.raises(ParamError):
        check_image(truncated)
    # A size not given: the image's aspect ratio at the model's default area, sides on the size multiple.
    caps = adapter.capabilities
    wide = adapter.resolve(SamplingParams(prompt="a dog", image=picture(200, 100)))
    assert wide.width > wide.height and wide.width % caps.size_multiple == 0
    assert abs(wide.width * wide.height / (caps.default_width * caps.default_height) - 1) < 0.2
    assert wide.strength == 0.6 and wide.steps_to_run < wide.num_inference_steps
    # A family that declares no mask refuses one; one that declares no image input, an image.
    adapter.capabilities = dataclasses.replace(caps, image_inputs=("img2img",))
    assert refused(image=IMAGES[0], mask=MASKS[0][0]) == "mask"
    adapter.capabilities = dataclasses.replace(caps, image_inputs=())
    assert refused(image=IMAGES[0]) == "image"


INPAINT = {
    "sd3": "StableDiffusion3InpaintPipeline",
    "sdxl": "StableDiffusionXLInpaintPipeline",
    "flux": "FluxInpaintPipeline",
    "z-image": "ZImageInpaintPipeline",
    "qwen-image": "QwenImageInpaintPipeline",
}
# (file, the "L" mask diffusers is handed): white boxes; one in OpenAI's convention (transparent: repainted).
MASKS = [mask(80, 64, (10, 8, 50, 40)), mask(64, 64, (32, 0, 64, 64), alpha=True), mask(32, 32, (0, 16, 32, 32))]


@pytest.mark.parametrize("family", list(INPAINT))
def test_inpainting_matches_diffusers_inpaint(family, request):
    """Masked edits (three masks, one with alpha, one of another size than its image) batched with an unmasked
    img2img and a text-to-image request, against each family's Inpaint pipeline."""
    fixture, _ = FAMILIES[family]
    checkpoint = request.getfixturevalue(fixture)
    adapter = load_adapter(checkpoint)
    sent = requests(family)
    masks = {0: MASKS[0], 2: MASKS[1], 4: MASKS[2]}  # 3 stays img2img, 1 text-to-image
    sent = [msgspec.structs.replace(p, mask=masks[i][0]) if i in masks else p for i, p in enumerate(sent)]
    handles, results, plans = asyncio.run(run_staggered(adapter, sent))
    assert max(len(p.advance) for p in plans) >= 3

    pipe = getattr(diffusers, adapter.pipeline_class).from_pretrained(checkpoint)
    inpaint = getattr(diffusers, INPAINT[family]).from_pipe(pipe)
    img2img = getattr(diffusers, FAMILIES[family][1]).from_pipe(pipe)
    for p in (pipe, inpaint, img2img):
        p.set_progress_bar_config(disable=True)

    def expected(params: SamplingParams, white) -> np.ndarray:
        """The Inpaint pipeline with the "L" mask `white`; without one, as test_edits_match_diffusers_img2img."""
        if white is None:
            return reference_edit((pipe, img2img), family, params)
        image = decoded(params.image)
        if family == "z-image":  # as reference_edit: it encodes the image at its own size
            image = inpaint.image_processor.resize(image, params.height, params.width)
        kwargs = dict(image=image, mask_image=white, strength=params.strength)
        if family != "sd3":
            return reference(inpaint, family, params, **kwargs)
        # StableDiffusion3InpaintPipeline decodes without the VAE's shift_factor, unlike every other SD3 pipeline
        # (diffusers issue 13611, finding 1): its latents, decoded as the SD3 pipeline decodes.
        latents = reference(inpaint, family, params, **kwargs, output_type="latent")[None]
        with torch.no_grad():
            decoded_image = pipe.vae.decode(latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor)
        return pipe.image_processor.postprocess(decoded_image.sample, output_type="np")[0]

    for i, (handle, result) in enumerate(zip(handles, results, strict=True)):
        assert isinstance(result, Completed), result
        params = handle.params
        assert sum(handle.request_id in p.advance for p in plans) == params.steps_to_run
        diff = float(np.abs(result.image - expected(params, masks[i][1] if i in masks else None)).max())
        print(f"{family} inpaint {params.prompt!r} mask {i in masks}: max abs diff {diff:.2e}")
        assert diff <= TOLERANCE, f"{params.prompt!r}: max abs diff {diff}"
    # Not vacuous: without its mask (img2img), or with another, the image clearly differs.
    first = handles[0].params
    for name, file, white in (("no mask", None, None), ("another mask", *MASKS[1])):
        other = expected(msgspec.structs.replace(first, mask=file), white)
        change = float(np.abs(other - results[0].image).max())
        print(f"{family} inpaint: {name} changes the image by {change:.3f}")
        assert change > 10 * TOLERANCE, name


def kontext_requests() -> list[SamplingParams]:
    """Edits of images of three aspect ratios, two of them with the same context size (the pipeline's ~1 Mpx one,
    1184x880) so that they share forwards, one at `edit_context: "output"` (scaled to the 64x64 output: 32x96), a
    text-to-image request, and true CFG on one."""
    same_aspect = picture(80, 64, seed=7)
    return [
        SamplingParams(prompt="make it red", image=IMAGES[0], seed=1, width=64, height=64, num_inference_steps=8),
        SamplingParams(prompt="a blue square", seed=2, width=64, height=64, num_inference_steps=4),
        SamplingParams(
            prompt="add a cat",
            image=same_aspect,
            seed=3,
            width=64,
            height=64,
            num_inference_steps=6,
            guidance_scale=5.0,
            preview_every=1,
        ),
        SamplingParams(
            prompt="turn the sky green",
            negative_prompt="blurry",
            true_cfg_scale=2.0,
            image=IMAGES[1],
            seed=4,
            width=64,
            height=64,
            num_inference_steps=5,
            edit_context="output",
        ),
        SamplingParams(prompt="remove the dog", image=IMAGES[2], seed=5, width=48, height=96, num_inference_steps=3),
    ]


def reference_kontext(pipe, adapter, params: SamplingParams) -> np.ndarray:
    """FluxKontextPipeline's `__call__` at the request's size (`max_area` its area, else it scales the output to
    1024x1024), handed the request's image as it is (the pipeline picks its context size: `_auto_resize`), or, at
    `edit_context: "output"`, handed the image at the smaller context size we chose (`_auto_resize` off), resized by
    its own image processor."""
    extra = {"max_area": params.width * params.height}
    if params.image is not None and params.edit_context == "output":
        width, height = adapter.requests.context_size(params)
        image = pipe.image_processor.resize(decoded(params.image), height, width)
        extra.update(image=image, _auto_resize=False)
    elif params.image is not None:
        extra.update(image=decoded(params.image))
    return reference(pipe, "flux", params, **extra)


def test_instruction_edits_match_diffusers_kontext(tiny_kontext):
    adapter = load_adapter(tiny_kontext)
    sent = kontext_requests()
    handles, results, plans = asyncio.run(run_staggered(adapter, sent))
    ids = [h.request_id for h in handles]
    # The two edits with the same context size share forwards; a different context size never joins them.
    assert any({ids[0], ids[2]} <= set(p.advance) for p in plans)
    for plan in plans:
        assert not ({ids[0], ids[3]} <= set(plan.advance) or {ids[0], ids[1]} <= set(plan.advance))

    pipe = diffusers.FluxKontextPipeline.from_pretrained(tiny_kontext)
    pipe.set_progress_bar_config(disable=True)
    for handle, result in zip(handles, results, strict=True):
        assert isinstance(result, Completed), result
        params = handle.params
        assert sum(handle.request_id in p.advance for p in plans) == params.num_inference_steps
        expected = reference_kontext(pipe, adapter, params)
        assert result.image.shape == expected.shape == (params.height, params.width, 3)
        diff = float(np.abs(result.image - expected).max())
        print(f"kontext {params.prompt!r} context {adapter.requests.context_size(params)}: max abs diff {diff:.2e}")
        assert diff <= TOLERANCE, f"{params.prompt!r}: max abs diff {diff}"
    # Not vacuous: another input image gives a clearly different image.
    first = handles[0].params
    other = reference_kontext(pipe, adapter, msgspec.structs.replace(first, image=picture(80, 64, seed=9)))
    change = float(np.abs(other - results[0].image).max())
    print(f"kontext: another image changes the output by {change:.3f}")
    assert change > 10 * TOLERANCE


def test_kontext_context_size_is_diffusers_choice_at_its_area(tiny_kontext):
    """The context is the resolution `FluxKontextPipeline(_auto_resize=True)` picks, at any output size (before: a
    256x256 output conditioned at 256x256, and its image differed from the pipeline's); `edit_context: "output"`
    scales it to the output's area; edits refuse `strength`, and a request without an image `edit_context`."""
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    adapter = load_adapter(tiny_kontext)
    for width, height in ((1000, 1000), (1600, 700), (700, 1600), (1300, 900)):
        params = SamplingParams(prompt="x", image=picture(width, height), width=1024, height=1024)
        _, w, h = min((abs(width / height - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
        assert adapter.requests.context_size(params) == (w // 16 * 16, h // 16 * 16)
    small = adapter.resolve(SamplingParams(prompt="x", image=picture(1000, 1000), width=256, height=256))
    assert small.edit_context == "preferred" and adapter.requests.context_size(small) == (1024, 1024)
    scaled = adapter.resolve(msgspec.structs.replace(small, edit_context="output"))
    assert adapter.requests.context_size(scaled) == (256, 256)
    with pytest.raises(ParamError) as info:
        adapter.resolve(SamplingParams(prompt="x", width=64, height=64, edit_context="output"))
    assert info.value.param == "edit_context"
    with pytest.raises(ParamError) as info:
        adapter.resolve(SamplingParams(prompt="x", image=IMAGES[0], strength=0.5))
    assert info.value.param == "strength"
    with pytest.raises(ParamError) as info:
        adapter.resolve(SamplingParams(prompt="x", image=b"not an image", width=64, height=64))
    assert info.value.param == "image"


@pytest.mark.parametrize("fixture", ["tiny_qwenimage_edit_plus", "tiny_qwenimage_edit_2511"])
def test_instruction_edits_match_qwen_image_edit_plus(fixture, request):
    """Qwen-Image-Edit-2509 (and 2511, whose image tokens are modulated at timestep 0): edits of one, two and three
    images, the prompt read beside the images by the VL text encoder and the images' latents joining every step,
    staggered; the two requests whose images have the same sizes share forwards, the others never join them; true
    CFG on some; one at the pipeline's default size (the last image's aspect at 1024x1024's area)."""
    checkpoint = request.getfixturevalue(fixture)
    adapter = load_adapter(checkpoint)
    two = [picture(96, 64, seed=4), picture(64, 64, seed=5)]
    sent = [
        SamplingParams(prompt="make it red", image=IMAGES[0], seed=1, width=64, height=64, num_inference_steps=4),
        SamplingParams(  # the same text as the first, another image: its own encoding (the text encoder reads both)
            prompt="make it red",
            image=picture(80, 64, seed=9),
            seed=3,
            width=64,
            height=64,
            num_inference_steps=5,
            preview_every=1,
        ),
        SamplingParams(
            prompt="put the cat on the sofa",
            negative_prompt="blurry",
            true_cfg_scale=3.0,
            image=two[0],
            reference_images=(two[1],),
            seed=2,
            width=64,
            height=64,
            num_inference_steps=3,
        ),
        SamplingParams(
            prompt="turn the sky green",
            image=IMAGES[1],
            reference_images=(IMAGES[2], picture(64, 96, seed=6)),
            seed=4,
            width=48,
            height=80,
            num_inference_steps=2,
        ),
    ]
    if fixture == "tiny_qwenimage_edit_2511":
        # Its layout differs in the per-token modulation only: two edits that share forwards (each 1 Mpx image
        # latent costs seconds on both sides here).
        sent = sent[:2]
    handles, results, plans = asyncio.run(run_staggered(adapter, sent))
    ids = [h.request_id for h in handles]
    assert any({ids[0], ids[1]} <= set(p.advance) for p in plans)  # the same image sizes: shared forwards
    for plan in plans:
        assert len(ids) < 3 or not ({ids[0], ids[2]} <= set(plan.advance) or {ids[1], ids[2]} <= set(plan.advance))
    pipe = diffusers.QwenImageEditPlusPipeline.from_pretrained(checkpoint)
    pipe.set_progress_bar_config(disable=True)
    for handle, result in zip(handles, results, strict=True):
        assert isinstance(result, Completed), result
        params = handle.params
        images = [decoded(d) for d in (params.image, *(params.reference_images or ()))]
        expected = reference(pipe, "qwen-image-edit-plus", params, image=images)
        assert result.image.shape == expected.shape == (params.height, params.width, 3)
        diff = float(np.abs(result.image - expected).max())
        print(f"{fixture} {params.prompt!r} ({len(images)} images): max abs diff {diff:.2e}")
        assert diff <= TOLERANCE, f"{params.prompt!r}: max abs diff {diff}"
    if len(handles) < 3:
        return
    # Not vacuous: another reference image changes the edit.
    second = handles[2].params
    other = reference(pipe, "qwen-image-edit-plus", second, image=[decoded(second.image), decoded(IMAGES[0])])
    assert float(np.abs(other - results[2].image).max()) > 10 * TOLERANCE
    # Defaults and refusals: the output's aspect is the last image's; no strength; at most three images; an image.
    resolved = adapter.resolve(SamplingParams(prompt="x", image=IMAGES[0], reference_images=(picture(64, 128),)))
    assert (resolved.width, resolved.height) == (736, 1440)  # calculate_dimensions(1024 * 1024, 0.5)
    for fields, param in (
        ({"image": IMAGES[0], "strength": 0.5}, "strength"),
        ({"image": IMAGES[0], "reference_images": (IMAGES[1],) * 3}, "reference_images"),
        ({}, "image"),
    ):
        with pytest.raises(ParamError) as info:
            adapter.resolve(SamplingParams(prompt="x", width=64, height=64, **fields))
        assert info.value.param == param


def test_instruction_edits_match_qwen_image_edit(tiny_qwenimage_edit):
    """The first Qwen-Image-Edit (`QwenImageEditPipeline`): one image, read and encoded at 1024x1024's area of its
    aspect; edits of images of the same aspect share forwards; true CFG on one; references are refused."""
    adapter = load_adapter(tiny_qwenimage_edit)
    sent = [
        SamplingParams(prompt="make it red", image=IMAGES[0], seed=1, width=64, height=64, num_inference_steps=4),
        SamplingParams(
            prompt="add a cat", image=picture(160, 128, seed=8), seed=2, width=64, height=64, num_inference_steps=3
        ),
        SamplingParams(
            prompt="a blue square",
            image=picture(80, 64, seed=9),
            seed=3,
            width=64,
            height=64,
            num_inference_steps=2,
            negative_prompt="dark",
            true_cfg_scale=2.5,
        ),
    ]
    handles, results, plans = asyncio.run(run_staggered(adapter, sent))
    ids = [h.request_id for h in handles]
    assert any({ids[0], ids[1]} <= set(p.advance) for p in plans)  # 80x64 and 160x128: one context size
    pipe = diffusers.QwenImageEditPipeline.from_pretrained(tiny_qwenimage_edit)
    pipe.set_progress_bar_config(disable=True)
    for handle, result in zip(handles, results, strict=True):
        assert isinstance(result, Completed), result
        params = handle.params
        expected = reference(pipe, "qwen-image-edit-plus", params, image=decoded(params.image))
        diff = float(np.abs(result.image - expected).max())
        print(f"qwen-image-edit {params.prompt!r}: max abs diff {diff:.2e}")
        assert diff <= TOLERANCE, f"{params.prompt!r}: max abs diff {diff}"
    with pytest.raises(ParamError) as info:
        adapter.resolve(SamplingParams(prompt="x", image=IMAGES[0], reference_images=(IMAGES[1],)))
    assert info.value.param == "reference_images"


@pytest.mark.parametrize(("family", "fixture"), [("flux2-klein", "tiny_flux2klein"), ("flux2", "tiny_flux2")])
def test_reference_edits_match_diffusers_flux2(family, fixture, request):
    """FLUX.2 [klein] and [dev] edits: the reference image's tokens (at its own size, ids on time axis 10) join
    every step's sequence; edits of the same context size share forwards; CFG on some (klein; [dev] embeds its
    guidance instead)."""
    checkpoint = request.getfixturevalue(fixture)
    negative = {"negative_prompt": "blurry"} if family == "flux2-klein" else {}
    same = picture(80, 64, seed=7)
    sent = [
        SamplingParams(prompt="make it red", image=IMAGES[0], seed=1, width=64, height=64, num_inference_steps=6),
        SamplingParams(prompt="a blue square", seed=2, width=64, height=64, num_inference_steps=4),
        SamplingParams(
            prompt="add a cat",
            image=same,
            seed=3,
            width=64,
            height=64,
            num_inference_steps=5,
            guidance_scale=6.0,
            preview_every=1,
        ),
        SamplingParams(
            prompt="remove the dog",
            **negative,
            image=picture(64, 128, seed=4),
            seed=4,
            width=64,
            height=96,
            num_inference_steps=3,
        ),
        # Two more references: three images' tokens (time ids 10, 20, 30) join the sequence.
        SamplingParams(
            prompt="put the cat on the sofa",
            image=IMAGES[1],
            reference_images=(picture(96, 64, seed=8), picture(64, 64, seed=9, fmt="JPEG")),
            seed=5,
            width=64,
            height=64,
            num_inference_steps=4,
        ),
    ]
    adapter = load_adapter(checkpoint)
    handles, results, plans = asyncio.run(run_staggered(adapter, sent))
    ids = [h.request_id for h in handles]
    assert any({ids[0], ids[2]} <= set(p.advance) for p in plans)
    pipe = getattr(diffusers, adapter.pipeline_class).from_pretrained(checkpoint)
    pipe.set_progress_bar_config(disable=True)

    def expected(params: SamplingParams) -> np.ndarray:
        if params.image is None:
            return reference(pipe, family, params)
        images = [decoded(f) for f in (params.image, *(params.reference_images or ()))]
        return reference(pipe, family, params, image=images if len(images) > 1 else images[0])

    for handle, result in zip(handles, results, strict=True):
        assert isinstance(result, Completed), result
        diff = float(np.abs(result.image - expected(handle.params)).max())
        print(f"{family} edit {handle.params.prompt!r}: max abs diff {diff:.2e}")
        assert diff <= TOLERANCE, f"{handle.params.prompt!r}: max abs diff {diff}"
    change = float(
        np.abs(expected(msgspec.structs.replace(handles[0].params, image=IMAGES[1])) - results[0].image).max()
    )
    print(f"{family} edit: another image changes the output by {change:.3f}")
    assert change > 10 * TOLERANCE
    last = handles[-1].params  # without its references, another image
    change = float(np.abs(expected(msgspec.structs.replace(last, reference_images=None)) - results[-1].image).max())
    print(f"{family} edit: dropping the references changes the output by {change:.3f}")
    assert change > 10 * TOLERANCE
    for fields, param in (
        ({"image": picture(32, 64)}, "image"),
        ({"image": IMAGES[1], "reference_images": (picture(600, 64),)}, "reference_images"),  # 9:1
        ({"reference_images": (IMAGES[1],)}, "reference_images"),  # without an image
    ):
        with pytest.raises(ParamError) as info:
            adapter.resolve(SamplingParams(prompt="x", **fields))
        assert info.value.param == param


def test_conditioned_generation_matches_diffusers_qwen_image_21(tiny_qwenimage21):
    """Qwen-Image 2.1 with condition images (read as RGBA at 1024x1024's area by the text encoder and the VAE, their
    latent tokens before the noisy ones): two edits of one image size and prompt length share forwards; an edit with
    a reference image and true CFG, and a text-only request, in the same run; each the pipeline's image."""
    sent = [
        SamplingParams(prompt="make it red", image=IMAGES[1], seed=1, width=64, height=64, num_inference_steps=4),
        SamplingParams(
            prompt="make it blue", image=picture(64, 64, seed=5), seed=2, width=64, height=64, num_inference_steps=3
        ),
        SamplingParams(
            prompt="add a cat",
            image=IMAGES[0],
            reference_images=(IMAGES[1],),
            negative_prompt="blurry",
            true_cfg_scale=3.0,
            seed=3,
            width=64,
            height=64,
            num_inference_steps=3,
        ),
        SamplingParams(prompt="a red square", seed=4, width=64, height=64, num_inference_steps=3),
    ]
    adapter = load_adapter(tiny_qwenimage21)
    calls: list[int] = []
    hook = adapter.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(len(kwargs["hidden_states"])), with_kwargs=True
    )
    try:
        handles, results, plans = asyncio.run(run_staggered(adapter, sent))
    finally:
        hook.remove()
    ids = [h.request_id for h in handles]
    assert any({ids[0], ids[1]} <= set(p.advance) for p in plans) and 2 in calls, calls  # one call, both edits
    pipe = diffusers.QwenImage21Pipeline.from_pretrained(tiny_qwenimage21)
    pipe.set_progress_bar_config(disable=True)

    def expected(params: SamplingParams) -> np.ndarray:
        if params.image is None:
            return reference(pipe, "qwen-image-21", params)
        images = [decoded(f) for f in (params.image, *(params.reference_images or ()))]
        return reference(pipe, "qwen-image-21", params, image=images)

    for handle, result in zip(handles, results, strict=True):
        assert isinstance(result, Completed), result
        diff = float(np.abs(result.image - expected(handle.params)).max())
        print(f"qwen-image-21 {handle.params.prompt!r}: max abs diff {diff:.2e}")
        assert diff <= TOLERANCE, f"{handle.params.prompt!r}: max abs diff {diff}"
    change = float(
        np.abs(expected(msgspec.structs.replace(handles[0].params, image=IMAGES[0])) - results[0].image).max()
    )
    print(f"qwen-image-21: another image changes the output by {change:.3f}")
    assert change > 10 * TOLERANCE
    for fields, param in (
        ({"image": IMAGES[1], "reference_images": (IMAGES[0],) * 3}, "reference_images"),
        ({"image": IMAGES[1], "strength": 0.5}, "strength"),
        ({"reference_images": (IMAGES[1],)}, "reference_images"),  # without an image
    ):
        with pytest.raises(ParamError) as info:
            adapter.resolve(SamplingParams(prompt="x", **fields))
        assert info.value.param == param
    # The output's size defaults to the last image's aspect at 1024x1024's area (48x96: 736x1440).
    size = adapter.resolve(SamplingParams(prompt="x", image=IMAGES[0], reference_images=(IMAGES[2],)))
    assert (size.width, size.height) == (736, 1440), (size.width, size.height)


def test_instruction_edits_match_longcat_image_edit(tiny_longcat_edit, monkeypatch):
    """LongCat-Image-Edit (`LongCatImageEditPipeline`): the image read beside the instruction by the VL text encoder
    and its latent joining every step; five staggered edits (mixed images, prompts, negative prompts, seeds, step
    counts, guidance; one without CFG), each equal to the pipeline's call. The pipeline takes no size: it sizes its
    output by the image's aspect at 1024x1024's area, as the request at the default size here (928x1152 for 80x64);
    the others send 64x64 and 48x80, which stand in for that size everywhere the pipeline reads it (its
    `calculate_dimensions` answers them in the reference). Two edits of other images at one size share forwards."""
    from diffusers.pipelines.longcat_image import pipeline_longcat_image_edit

    adapter = load_adapter(tiny_longcat_edit)
    assert adapter.family == "longcat-image-edit"
    small = dict(width=64, height=64)
    sent = [
        SamplingParams(prompt="make it red", image=IMAGES[0], seed=1, num_inference_steps=4, **small),
        SamplingParams(  # the same text, another image: its own encoding (the text encoder reads both)
            prompt="make it red",
            negative_prompt="blurry",
            image=IMAGES[1],
            seed=2,
            num_inference_steps=5,
            guidance_scale=3.0,
            preview_every=1,
            **small,
        ),
        SamplingParams(prompt="a blue sky", image=IMAGES[2], seed=3, num_inference_steps=3, width=48, height=80),
        SamplingParams(
            prompt="no guidance", image=IMAGES[0], seed=4, num_inference_steps=3, guidance_scale=1.0, **small
        ),
        SamplingParams(prompt="turn it green", image=IMAGES[0], seed=5, num_inference_steps=2),  # the default size
    ]
    handles, results, plans = asyncio.run(run_staggered(adapter, sent))
    ids = [h.request_id for h in handles]
    assert any({ids[0], ids[1]} <= set(p.advance) for p in plans)  # one size, CFG: shared forwards
    assert (handles[4].params.width, handles[4].params.height) == (1152, 928)  # calculate_dimensions(2**20, 1.25)
    pipe = diffusers.LongCatImageEditPipeline.from_pretrained(tiny_longcat_edit)
    pipe.set_progress_bar_config(disable=True)
    # The served VAE is channels-last on the CPU (models/loading/pipelines.py): decoding 1 Mpx so rounds otherwise
    # (7.8e-4 here, the transformer's outputs equal to the bit); the reference's decoder takes the same layout.
    channels_last_vae(pipe.vae)
    default = pipeline_longcat_image_edit.calculate_dimensions

    def expected(params: SamplingParams, image: bytes, **change) -> np.ndarray:
        sized = default if params is handles[4].params else lambda area, ratio: (params.width, params.height)
        monkeypatch.setattr(pipeline_longcat_image_edit, "calculate_dimensions", sized)
        return reference(
            pipe, "longcat-image-edit", SamplingParams(**{**_fields(params), **change}), image=decoded(image)
        )

    for handle, result in zip(handles, results, strict=True):
        assert isinstance(result, Completed), result
        params = handle.params
        want = expected(params, params.image)
        assert result.image.shape == want.shape == (params.height, params.width, 3)
        diff = float(np.abs(result.image - want).max())
        print(f"longcat-image-edit {params.prompt!r} {params.width}x{params.height}: max abs diff {diff:.2e}")
        assert diff <= TOLERANCE, f"{params.prompt!r}: max abs diff {diff}"
    # Not vacuous: another image, instruction or guidance changes the edit.
    first = handles[0].params
    for image, change in (
        (IMAGES[1], {}),
        (first.image, {"prompt": "a drawing of a dog"}),
        (first.image, {"guidance_scale": 7.0}),
    ):
        assert float(np.abs(expected(first, image, **change) - results[0].image).max()) > 10 * TOLERANCE, change
    # Refusals: an image is needed, strength and references do not apply, nor LongCat-Image's call switches.
    for fields, param in (
        ({}, "image"),
        ({"image": IMAGES[0], "strength": 0.5}, "strength"),
        ({"image": IMAGES[0], "reference_images": (IMAGES[1],)}, "reference_images"),
        ({"image": IMAGES[0], "arguments": {"enable_prompt_rewrite": False}}, "arguments"),
        ({"image": b"not an image"}, "image"),
    ):
        with pytest.raises(ParamError) as info:
            adapter.resolve(SamplingParams(prompt="x", **small, **fields))
        assert info.value.param == param


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in params.__struct_fields__}
