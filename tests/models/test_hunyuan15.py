"""HunyuanVideo-1.5 against diffusers' own `HunyuanVideo15Pipeline` / `HunyuanVideo15ImageToVideoPipeline.__call__`.

Requests differ in prompt (one with "quoted" glyph text), seed, steps, guidance (one without CFG), negative prompt
and frame count, and join running batches. The pipeline's guidance is its guider's: the reference sets
`pipe.guider = pipe.guider.new(guidance_scale=...)` per request. Float32 on CPU. Tolerance: max abs diff <= 1e-4
on the decoded float frames (measured: about 1.4e-6).
"""

import asyncio
import io

import diffusers
import numpy as np
import pytest
import torch
from engines import run_staggered
from pictures import picture
from PIL import Image

from diffusiond.engine.outputs import Completed
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import ParamError, SamplingParams

TOLERANCE = 1e-4


def clip(prompt: str, seed: int, frames: int = 9, steps: int = 3, **more) -> SamplingParams:
    size = {} if "image" in more else {"width": 64, "height": 64}
    return SamplingParams(prompt=prompt, seed=seed, num_frames=frames, num_inference_steps=steps, **size, **more)


def reference(pipe, p: SamplingParams) -> np.ndarray:
    pipe.guider = pipe.guider.new(guidance_scale=p.guidance_scale)
    extra = {"image": Image.open(io.BytesIO(p.image))} if p.image else {"width": p.width, "height": p.height}
    return pipe(
        prompt=p.prompt,
        negative_prompt=p.negative_prompt,
        num_frames=p.num_frames,
        num_inference_steps=p.num_inference_steps,
        generator=torch.Generator().manual_seed(p.seed),
        output_type="np",
        **extra,
    ).frames[0]


def load_pipe(checkpoint: str):
    index = diffusers.DiffusionPipeline.load_config(checkpoint)
    pipe = getattr(diffusers, index["_class_name"]).from_pretrained(checkpoint)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def check_staggered(checkpoint: str, requests) -> tuple[list, list]:
    adapter = load_adapter(checkpoint)
    handles, results, plans = asyncio.run(run_staggered(adapter, requests))
    joined = [p for p in plans if p.new and set(p.advance) - {n.request_id for n in p.new}]
    assert joined and max(len(p.advance) for p in plans) >= 2
    pipe = load_pipe(checkpoint)
    for handle, result in zip(handles, results, strict=True):
        assert isinstance(result, Completed), result
        expected = reference(pipe, handle.params)
        assert result.image.shape == expected.shape == (handle.params.num_frames, handle.params.height,
                                                        handle.params.width, 3)  # fmt: skip
        diff = float(np.abs(result.image - expected).max())
        print(f"{handle.params.prompt!r} ({handle.params.num_frames} frames): max abs diff {diff:.2e}")
        assert diff <= TOLERANCE, (handle.params.prompt, diff)
    return handles, results


def test_text_to_video_matches_the_pipeline(tiny_hunyuan15):
    requests = [
        clip("a red cat walking", 1, steps=8),
        clip('a blue dog with a sign saying "hello"', 2, steps=6, negative_prompt="blurry", guidance_scale=3.0),
        clip("a green bird", 3, frames=5, steps=5),  # another batch key
        clip("a yellow fish", 4, steps=5, guidance_scale=1.0),  # no CFG: one row, in the same batch
        clip("a white horse", 5, steps=4, guidance_scale=8.0),
    ]
    handles, results = check_staggered(tiny_hunyuan15, requests)
    pipe = load_pipe(tiny_hunyuan15)
    fields = {f: getattr(handles[1].params, f) for f in handles[1].params.__struct_fields__}
    for change in ({"seed": 99}, {"prompt": "a blue dog with a sign"}, {"guidance_scale": 6.0}):
        other = reference(pipe, SamplingParams(**{**fields, **change}))
        assert float(np.abs(other - results[1].image).max()) > 100 * TOLERANCE, change


def test_image_to_video_matches_the_pipeline(tiny_hunyuan15_i2v):
    """The clip's size is the image's aspect bucket (the pipeline takes no size); text and images batch by size."""
    requests = [
        clip("a red cat", 1, steps=8, image=picture(64, 64, seed=1)),
        clip("a blue dog", 2, steps=6, image=picture(64, 64, seed=2), negative_prompt="dark"),
        clip("a green bird", 3, steps=5, image=picture(70, 40, seed=3)),  # an 80x48 clip
        clip("a yellow fish", 4, steps=5, image=picture(64, 64, seed=4), guidance_scale=1.0),
    ]
    handles, results = check_staggered(tiny_hunyuan15_i2v, requests)
    assert (handles[2].params.width, handles[2].params.height) == (80, 48)
    other = reference(load_pipe(tiny_hunyuan15_i2v), SamplingParams(**{
        **{f: getattr(handles[0].params, f) for f in handles[0].params.__struct_fields__},
        "image": picture(64, 64, seed=7),
    }))  # fmt: skip
    assert float(np.abs(other - results[0].image).max()) > 100 * TOLERANCE  # the image matters


def test_one_call_per_step_for_the_whole_batch(tiny_hunyuan15):
    """Every request's rows in one transformer call (a negative row where it guides); per-request forwards would
    make one call each (red). The batch's outputs are each request's alone."""
    adapter = load_adapter(tiny_hunyuan15)
    requests = [clip("a red cat", 1), clip("a blue dog", 2, guidance_scale=1.0), clip("a green bird", 3)]
    states = adapter.prepare([(str(i), adapter.resolve(p)) for i, p in enumerate(requests)])
    calls = []
    hook = adapter.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(len(kwargs["hidden_states"])), with_kwargs=True
    )
    try:
        batched = adapter.denoise(states)
        assert calls == [5]
        alone = torch.cat([adapter.denoise([s]) for s in states])
    finally:
        hook.remove()
    assert float((batched - alone).abs().max()) < 1e-5


def test_attention_masks_keys_only(tiny_hunyuan15, monkeypatch):
    """The pipeline's processor builds a [B, 1, L, L] mask in every block (gigabytes per row at real sizes); ours a
    [B, 1, 1, L] key mask, over the same keys (the parity tests above hold with it). With the stock processor back:
    red."""
    adapter = load_adapter(tiny_hunyuan15)
    states = adapter.prepare([("0", adapter.resolve(clip("a red cat", 1))), ("1", adapter.resolve(clip("a dog", 2)))])
    masks = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):  # diffusers' dispatch passes query=, key=, value= by name
        mask = kwargs.get("attn_mask")
        masks.append(None if mask is None else tuple(mask.shape))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    adapter.denoise(states)
    blocks = len(adapter.transformer.transformer_blocks)
    joint = [m for m in masks if m is not None and m[-1] > 1000]  # over video and text (the refiner's: text only)
    assert len(joint) == blocks and all(m[2] == 1 for m in joint), masks


def test_defaults_are_the_pipeline_s_and_bad_requests_name_the_field(tiny_hunyuan15, tiny_hunyuan15_i2v):
    adapter = load_adapter(tiny_hunyuan15)
    resolved = adapter.resolve(SamplingParams(prompt="a cat"))
    # The 16:9 bucket of the transformer's target size (the real 480p checkpoint's: 848x480), the guider's scale.
    assert (resolved.width, resolved.height, resolved.num_frames, resolved.fps) == (80, 48, 121, 24)
    assert (resolved.num_inference_steps, resolved.guidance_scale) == (50, 6.0)
    for fields, param in (
        ({"num_frames": 10}, "num_frames"),  # 1 + 4k
        ({"width": 40}, "width"),  # not a multiple of 16
        ({"image": picture(64, 64)}, "image"),  # a text-to-video checkpoint
    ):
        with pytest.raises(ParamError) as info:
            adapter.resolve(SamplingParams(prompt="a cat", **fields))
        assert info.value.param == param, fields
    i2v = load_adapter(tiny_hunyuan15_i2v)
    for fields, param in (({}, "image"), ({"image": picture(64, 64), "width": 48}, "width")):
        with pytest.raises(ParamError) as info:
            i2v.resolve(SamplingParams(prompt="a cat", **fields))
        assert info.value.param == param, fields


@pytest.mark.parametrize("family", ["hunyuan-video-15", "hunyuan-video-15-i2v"])
def test_make_tiny_writes_the_checkpoint(family, tmp_path):
    from diffusiond.daemon.cli import main
    from diffusiond.models.preview import load_preview_factors

    assert main(["make-tiny", "--family", family, "--out", str(tmp_path)]) == 0
    fitted = load_preview_factors(tmp_path)
    assert fitted is not None and fitted.source == "fitted" and len(fitted.factors) == 8
    assert load_pipe(str(tmp_path)).vae_scale_factor_temporal == 4
