"""FLUX.3 [klein] on the generic path (`make-tiny --family flux3-klein`): its Modular pipeline (`Flux3AutoBlocks`)
runs a prompt upsampler (a Qwen3.5 model generating the caption greedily) before its Qwen3-VL text encoder. The folder
loads as `Flux3ModularPipeline`; staggered requests, each with a small `max_new_tokens` in `arguments` (under the
default, 3584, a random upsampler rambles for hundreds or thousands of tokens), equal the Modular pipeline's own call;
the upsampler's caption is what reaches the text encoder."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest
import torch
from engines import run_staggered

from diffusiond.engine.outputs import Completed, Failed
from diffusiond.models.generic.adapter import GenericAdapter
from diffusiond.models.generic.calls import Call, CallFailed
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import ParamError, SamplingParams

SHORT = {"max_new_tokens": 4}


def params(prompt: str, seed: int, steps: int, **more) -> SamplingParams:
    return SamplingParams(
        prompt=prompt, seed=seed, width=64, height=64, num_inference_steps=steps, arguments=SHORT, **more
    )


REQUESTS = [
    params("a red circle", 1, 3),
    params("a blue square", 2, 2, negative_prompt="noise"),
    params("a green cat", 3, 4, negative_prompt="a dark room"),
]


@pytest.fixture(scope="module")
def modular(tiny_flux3_klein):
    from diffusers.modular_pipelines import ModularPipeline

    pipe = ModularPipeline.from_pretrained(tiny_flux3_klein)
    pipe.load_components(dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def served(tiny_flux3_klein):
    """The three requests, staggered, through an engine on the generic path."""
    _, results, _ = asyncio.run(run_staggered(load_adapter(tiny_flux3_klein), REQUESTS))
    for result in results:
        assert isinstance(result, Completed), result
    return [r.image for r in results]


def call(pipe, p: SamplingParams, output: str = "images", **more):
    return pipe(
        prompt=p.prompt, negative_prompt=p.negative_prompt, height=p.height, width=p.width,
        num_inference_steps=p.num_inference_steps, generator=torch.Generator().manual_seed(p.seed),
        output=output, output_type="np", **p.arguments, **more,
    )  # fmt: skip


def without_upsampler(pipe):
    """The same components, the blocks without their `prompt_upsampler` step: the prompt encoded as given."""
    from diffusers.modular_pipelines.flux3.modular_blocks_flux3 import Flux3AutoBlocks

    blocks = Flux3AutoBlocks()
    blocks.sub_blocks.pop("prompt_upsampler")
    bare = blocks.init_pipeline()
    bare.update_components(**{k: v for k, v in pipe.components.items() if not k.startswith("prompt_upsampler")})
    bare.set_progress_bar_config(disable=True)
    return bare


def test_the_folder_loads_on_the_generic_path(tiny_flux3_klein):
    adapter = load_adapter(tiny_flux3_klein)
    assert isinstance(adapter, GenericAdapter) and adapter.call.modular and adapter.call.steps == "loop"
    caps = adapter.capabilities.public()
    assert caps["mode"] == "generic" and caps["pipeline"] == "Flux3ModularPipeline"
    assert {"max_new_tokens", "num_inference_steps"} <= set(caps["fields"]) and caps["negative_prompt"]
    assert adapter.call.default("max_new_tokens") == 3584  # the blocks' own default
    # Both processors reload as what AutoProcessor gives for Qwen3.5 and Qwen3-VL; the image processor, scheduler and
    # guider (not saved: created from the blocks' specs) as the blocks declare them.
    pipe = adapter.pipe
    assert type(pipe.prompt_upsampler_processor).__name__ == type(pipe.tokenizer).__name__ == "Qwen3VLProcessor"
    assert type(pipe.prompt_upsampler_processor.tokenizer).__name__ == "Qwen3_5Tokenizer"
    assert type(pipe.image_processor).__name__ == "Flux3ImageProcessor" and pipe.scheduler.config.shift == 6.93


def test_staggered_requests_equal_the_modular_pipeline_s_own_call(modular, served):
    # Each prompt's caption is its own, so a request given another's prompt would show.
    captions = [call(modular, p, output="prompt") for p in REQUESTS]
    assert len(set(captions)) == len(REQUESTS), captions
    for p, image in zip(REQUESTS, served, strict=True):
        assert float(np.abs(image - call(modular, p)[0]).max()) <= 1e-4


def test_the_upsampler_s_caption_reaches_the_text_encoder(modular, served):
    p = REQUESTS[0]
    caption = call(modular, p, output="prompt")
    assert caption.strip() and caption != p.prompt, caption
    bare = without_upsampler(modular)
    # The served image is the caption's, not the bare prompt's: the blocks without the upsampler make it from the
    # caption, and something else from the prompt.
    captioned = call(bare, msgspec.structs.replace(p, prompt=caption, arguments={}))[0]
    assert float(np.abs(served[0] - captioned).max()) <= 1e-4
    as_given = call(bare, msgspec.structs.replace(p, arguments={}))[0]
    assert float(np.abs(served[0] - as_given).max()) > 1e-2


def test_guidance_scale_reaches_the_call_s_own_guider(tiny_flux3_klein, modular):
    """FLUX.3's guidance lives in its guider's settings (ClassifierFreeGuidance, 3.5), not in its inputs: a request's
    guidance_scale is set on its call's own guider, the others' untouched."""
    from diffusers import ClassifierFreeGuidance

    adapter = load_adapter(tiny_flux3_klein)
    caps = adapter.capabilities.public()
    assert caps["default_guidance_scale"] == 3.5 and "guidance_scale" in caps["fields"]
    strong, default = params("a red circle", 1, 2, guidance_scale=6.0), params("a red circle", 1, 2)
    _, results, _ = asyncio.run(run_staggered(adapter, [strong, default]))
    assert all(isinstance(r, Completed) for r in results), results
    assert adapter.pipe.guider.guidance_scale == 3.5  # the loaded pipeline's own guider kept its setting
    modular.update_components(guider=ClassifierFreeGuidance(guidance_scale=6.0))
    try:
        want = call(modular, strong)[0]
    finally:
        modular.update_components(guider=ClassifierFreeGuidance(guidance_scale=3.5))
    assert float(np.abs(results[0].image - want).max()) <= 1e-4
    assert float(np.abs(results[1].image - call(modular, default)[0]).max()) <= 1e-4
    assert float(np.abs(results[0].image - results[1].image).max()) > 1e-3


def test_sizes_and_fields_are_the_call_s(tiny_flux3_klein):
    """Its sides are multiples of 16 (FLUX.3 packs 2x2 latents: a 72x72 request is a 400 naming width, not a
    failure inside the call); its default is the text-to-image branch's 1024x1024; what its blocks compute (a
    reference's latents, its crop) is no request's."""
    adapter = load_adapter(tiny_flux3_klein)
    caps = adapter.capabilities
    assert caps.size_multiple == 16 and (caps.default_width, caps.default_height) == (1024, 1024)
    with pytest.raises(ParamError) as refused:
        adapter.resolve(msgspec.structs.replace(params("x", 1, 2), width=72, height=72))
    assert refused.value.param == "width"
    assert not {"image_cond_latents", "reference_crop"} & set(caps.fields)
    with pytest.raises(ParamError) as refused:
        adapter.resolve(msgspec.structs.replace(params("x", 1, 2), arguments={"reference_crop": [0.0, 1.0]}))
    assert refused.value.param == "arguments"
    assert adapter.resolve(SamplingParams(prompt="x", seed=1)).width == 1024


def test_a_call_that_refuses_its_arguments_says_why(tiny_flux3_klein):
    """A ValueError of the pipeline's own checks before its first step (a Modular pipeline's blocks check inside the
    call) is the client's message, not an internal error; one after it started stays the server's."""
    adapter = load_adapter(tiny_flux3_klein)

    def refuse(members):
        def run(call):
            raise ValueError("`height` and `width` have to be divisible by 16 but are 72 and 72.")

        return run

    adapter._runner = refuse
    _, (result,), _ = asyncio.run(run_staggered(adapter, [params("x", 1, 2)]))
    assert isinstance(result, Failed) and "divisible by 16" in result.error, result
    call = Call(["r"], lambda c: (c.ready(2), c.stepped(None), (_ for _ in ()).throw(ValueError("late")))[-1])
    call.start()
    with pytest.raises(CallFailed):
        call.advance()
        call.advance()
