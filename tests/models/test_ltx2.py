"""LTX-2 (video with sound) against diffusers' own `LTX2Pipeline.__call__`, and its guidance passes batched.

Requests differ in prompt, seed, steps, frames, every guidance (CFG of either modality off, STG on other blocks,
modality guidance off, no rescale) and join running batches. Float32 on CPU. Tolerance: max abs diff <= 1e-4 on the
decoded float frames and on the vocoder's waveform (measured: about 2e-6).
"""

import asyncio
import io

import diffusers
import numpy as np
import pytest
import torch
from engines import run_staggered
from PIL import Image

from diffusiond.engine.outputs import Completed
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import ParamError, SamplingParams

TOLERANCE = 1e-4


def clip(prompt: str, seed: int, frames: int = 9, steps: int = 3, **more) -> SamplingParams:
    return SamplingParams(
        prompt=prompt, seed=seed, width=64, height=64, num_frames=frames, num_inference_steps=steps, **more
    )


def reference(pipe, p: SamplingParams, **extra) -> tuple[np.ndarray, np.ndarray]:
    """The pipeline's frames [F, H, W, 3] and waveform [2, samples] for resolved `p`. The pipeline takes an audio
    knob of 0 for "the video's value" (`audio_stg_scale or stg_scale`); diffusiond's 0 is 0, which the pipeline is
    handed as 1e-12 (a delta 1e-12 times as large: none within the tolerance)."""
    audio_knobs = ("audio_guidance_scale", "audio_stg_scale", "audio_modality_scale", "audio_guidance_rescale")
    audio_knobs = {name: getattr(p, name) or 1e-12 for name in audio_knobs}
    video, audio = pipe(
        prompt=p.prompt,
        negative_prompt=p.negative_prompt,
        width=p.width,
        height=p.height,
        num_frames=p.num_frames,
        frame_rate=float(p.fps),
        num_inference_steps=p.num_inference_steps,
        guidance_scale=p.guidance_scale,
        stg_scale=p.stg_scale,
        modality_scale=p.modality_scale,
        guidance_rescale=p.guidance_rescale,
        **audio_knobs,
        # The pipeline's default blocks (28) do not exist in the tiny transformer: no perturbation, as ours.
        spatio_temporal_guidance_blocks=list(p.stg_blocks) if p.stg_blocks else [28],
        generator=torch.Generator().manual_seed(p.seed),
        output_type="np",
        return_dict=False,
        **extra,
    )
    return video[0], np.asarray(audio[0])


@pytest.fixture(scope="module")
def ltx2(tiny_ltx2):
    pipe = diffusers.LTX2Pipeline.from_pretrained(tiny_ltx2)
    pipe.set_progress_bar_config(disable=True)
    return load_adapter(tiny_ltx2), pipe


def test_video_and_sound_match_the_pipeline(ltx2):
    adapter, pipe = ltx2
    caps = adapter.capabilities
    assert (caps.modality, caps.audio_sample_rate, caps.frame_step, caps.default_fps) == ("video", 24000, 8, 24)
    requests = [
        clip("a red cat walking", 1, steps=12),
        clip("a blue dog on the grass", 2, negative_prompt="blurry", steps=10, guidance_scale=4.0, stg_blocks=(1,)),
        clip("a green bird", 3, frames=17, steps=6, audio_guidance_scale=5.0, preview_every=1),
        # Positive rows only: no CFG in either modality, no modality guidance.
        clip(
            "a yellow fish",
            4,
            steps=8,
            guidance_scale=1.0,
            audio_guidance_scale=1.0,
            modality_scale=1.0,
            audio_modality_scale=1.0,
        ),
        # Other STG blocks (a call of their own), no rescale, the audio's STG off.
        clip("a white horse", 5, steps=6, stg_blocks=(0, 1), stg_scale=2.0, audio_stg_scale=0.0, guidance_rescale=0.0),
    ]
    handles, results, plans = asyncio.run(run_staggered(adapter, requests))
    joined = [p for p in plans if p.new and set(p.advance) - {n.request_id for n in p.new}]
    assert joined and max(len(p.advance) for p in plans) >= 3
    for handle, result in zip(handles, results, strict=True):
        assert isinstance(result, Completed), result
        video, audio = reference(pipe, handle.params)
        assert result.image.shape == video.shape == (handle.params.num_frames, 64, 64, 3)
        assert result.audio is not None and result.audio.sample_rate == 24000
        assert result.audio.samples.shape == audio.shape and audio.shape[0] == 2
        diffs = float(np.abs(result.image - video).max()), float(np.abs(result.audio.samples - audio).max())
        print(f"{handle.params.prompt!r}: max abs diff frames {diffs[0]:.1e}, waveform {diffs[1]:.1e}")
        assert max(diffs) <= TOLERANCE, (handle.params.prompt, diffs)
    # Not vacuous: each knob moves the frames or the sound clearly.
    first = requests[1]
    fields = {f: getattr(handles[1].params, f) for f in first.__struct_fields__}
    for change in (
        {"seed": 99},
        {"prompt": "a drawing of a black car"},
        {"guidance_scale": 8.0},
        {"audio_guidance_scale": 2.0},
        {"stg_scale": 3.0},
        {"modality_scale": 1.0},
        {"guidance_rescale": 0.0},
    ):
        video, audio = reference(pipe, SamplingParams(**{**fields, **change}))
        moved = max(np.abs(video - results[1].image).max(), np.abs(audio - results[1].audio.samples).max())
        assert float(moved) > 100 * TOLERANCE, change


def test_each_guidance_pass_is_one_call_for_the_whole_batch(ltx2):
    """A batch runs the pipeline's passes once each, over every request's rows: CFG (two rows per request with CFG,
    one without), STG (one call per set of blocks), modality isolation. Per-request forwards would make more calls
    (each request alone: 6 calls here). And the batch's outputs are each request's alone."""
    adapter, _ = ltx2
    requests = [
        clip("a red cat", 1),  # CFG and modality guidance
        clip("a blue dog", 2, stg_blocks=(1,)),  # and STG
        clip(
            "a green bird",
            3,
            guidance_scale=1.0,
            audio_guidance_scale=1.0,
            modality_scale=1.0,
            audio_modality_scale=1.0,
        ),
    ]
    states = adapter.prepare([(str(i), adapter.resolve(p)) for i, p in enumerate(requests)])
    calls = []
    forward = adapter.transformer.forward

    def counting(*args, **kwargs):
        calls.append((kwargs["hidden_states"].shape[0], kwargs["isolate_modalities"]))
        return forward(*args, **kwargs)

    adapter.transformer.forward = counting
    try:
        batched = adapter.denoise(states)
        assert calls == [(5, False), (1, False), (2, True)]
        alone = torch.cat([adapter.denoise([s]) for s in states])
    finally:
        del adapter.transformer.forward
    assert len(calls) == 3 + 6  # alone: 2 + 3 + 1 calls
    assert float((batched - alone).abs().max()) < 1e-5


def test_previews_show_the_video_frames(ltx2):
    adapter, _ = ltx2
    params = adapter.resolve(clip("a red cat", 1, frames=17, preview_every=1))
    (state,) = adapter.prepare([("a", params)])
    x0 = adapter.predicted_x0(state, adapter.denoise([state]))  # [C, T, h, w]: 3 latent frames of 2 x 2
    assert tuple(x0.shape) == (16, 3, 2, 2)
    assert adapter.preview(x0).shape == (2, 6, 3)
    (full,) = adapter.preview_vae(x0[None])
    assert full.shape == (64, 64 * 3, 3)


def test_defaults_are_the_pipeline_s_and_bad_requests_name_the_field(ltx2, tiny_wan):
    adapter, _ = ltx2
    resolved = adapter.resolve(SamplingParams(prompt="a cat"))
    assert (resolved.width, resolved.height, resolved.num_frames, resolved.fps) == (768, 512, 121, 24)
    assert (resolved.num_inference_steps, resolved.guidance_scale, resolved.audio_guidance_scale) == (30, 3.0, 7.0)
    assert (resolved.stg_scale, resolved.modality_scale, resolved.guidance_rescale) == (1.0, 3.0, 0.7)
    assert resolved.stg_blocks is None  # the pipeline's block 28 is past the tiny transformer's 2
    for fields, param in (
        ({"num_frames": 10}, "num_frames"),  # 1 + 8k
        ({"width": 32}, "width"),  # one latent pixel: the decoder cannot pad it
        ({"width": 80}, "width"),  # not a multiple of 32
        ({"stg_blocks": (2,)}, "stg_blocks"),
        ({"true_cfg_scale": 2.0}, "true_cfg_scale"),
    ):
        with pytest.raises(ParamError) as info:
            adapter.resolve(SamplingParams(prompt="a cat", **fields))
        assert info.value.param == param, fields
    with pytest.raises(ParamError) as info:  # a family without sound refuses the audio-video knobs
        load_adapter(tiny_wan).resolve(SamplingParams(prompt="a cat", audio_guidance_scale=2.0))
    assert info.value.param == "audio_guidance_scale"


def test_make_tiny_writes_the_checkpoint(tmp_path):
    """`diffusiond make-tiny --family ltx2`: the pipeline's own `from_pretrained` loads it, and its preview map is
    fitted through the family's decode (one-frame clips)."""
    from diffusiond.daemon.cli import main
    from diffusiond.models.preview import load_preview_factors

    assert main(["make-tiny", "--family", "ltx2", "--out", str(tmp_path)]) == 0
    fitted = load_preview_factors(tmp_path)
    assert fitted is not None and fitted.source == "fitted" and len(fitted.factors) == 16
    pipe = diffusers.LTX2Pipeline.from_pretrained(tmp_path)
    assert pipe.vae_temporal_compression_ratio == 8 and pipe.vocoder.config.output_sampling_rate == 24000


def test_image_to_video_with_sound_matches_the_pipeline(ltx2, tiny_ltx2_i2v):
    """The image is the first frame: a timestep per video token (0 on the image's), the image's latents kept at
    every step; the same checkpoint serves text and image to video (not in one batch: the timesteps' shapes differ),
    and a checkpoint saved as `LTX2ImageToVideoPipeline` serves images only."""
    from pictures import picture

    adapter, pipe = ltx2
    i2v = diffusers.LTX2ImageToVideoPipeline.from_pipe(pipe)
    red, blue = picture(64, 64, seed=1), picture(96, 64, seed=2)
    requests = [
        clip("a red cat walking", 1, steps=10, image=red),
        clip("a blue dog", 2, steps=8, image=blue, negative_prompt="blurry", stg_blocks=(1,)),
        clip("a green bird", 3, steps=8),  # text to video beside them
        clip("a yellow fish", 4, frames=17, steps=6, image=red, guidance_scale=1.0, audio_guidance_scale=1.0),
    ]
    handles, results, plans = asyncio.run(run_staggered(adapter, requests))
    assert max(len(p.advance) for p in plans) >= 2
    for handle, result in zip(handles, results, strict=True):
        assert isinstance(result, Completed), result
        p = handle.params
        image = Image.open(io.BytesIO(p.image)) if p.image is not None else None
        video, audio = reference(i2v if image is not None else pipe, p, **({"image": image} if image else {}))
        diffs = float(np.abs(result.image - video).max()), float(np.abs(result.audio.samples - audio).max())
        print(f"{p.prompt!r}: max abs diff frames {diffs[0]:.1e}, waveform {diffs[1]:.1e}")
        assert max(diffs) <= TOLERANCE, (p.prompt, diffs)
    # Not vacuous: another image changes the clip.
    other, _ = reference(i2v, handles[0].params, image=Image.open(io.BytesIO(blue)))
    assert float(np.abs(other - results[0].image).max()) > 100 * TOLERANCE
    only = load_adapter(tiny_ltx2_i2v)
    assert only.capabilities.family == "ltx2-i2v"
    with pytest.raises(ParamError) as info:
        only.resolve(SamplingParams(prompt="a cat"))
    assert info.value.param == "image"


def test_lora_requests_match_the_pipeline(tiny_ltx2, tmp_path):
    """Two adapters and none in one running batch, each request's rows with its own (every pass: CFG, STG,
    modality); each clip and its sound equal the pipeline with `load_lora_weights` + `set_adapters`."""
    import warnings

    from diffusiond.models.params import LoraChoice
    from diffusiond.models.tiny.lora import build_tiny_lora

    files = {n: build_tiny_lora(tiny_ltx2, tmp_path / f"{n}.safetensors", seed=i + 1) for i, n in enumerate("ab")}
    adapter = load_adapter(tiny_ltx2)
    registry = adapter.enable_lora(1 << 30)
    for name, path in files.items():
        registry.register(name, str(path))
    requests = [
        clip("a red cat", 1, steps=10, lora=(LoraChoice("a", 1.0),), stg_blocks=(1,)),
        clip("a blue dog", 2, steps=8, lora=(LoraChoice("b", 0.7),)),
        clip("a green bird", 3, steps=6),
    ]
    handles, results, plans = asyncio.run(run_staggered(adapter, requests))
    assert max(len(p.advance) for p in plans) == 3
    pipe = diffusers.LTX2Pipeline.from_pretrained(tiny_ltx2)
    pipe.set_progress_bar_config(disable=True)
    with warnings.catch_warnings():  # no text encoder weights in these files
        warnings.simplefilter("ignore")
        for name, path in files.items():
            pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=name)
    for handle, result in zip(handles, results, strict=True):
        assert isinstance(result, Completed), result
        params = handle.params
        pipe.disable_lora()
        plain, _ = reference(pipe, params)
        if params.lora:
            pipe.enable_lora()
            pipe.set_adapters([c.name for c in params.lora], adapter_weights=[c.scale for c in params.lora])
        video, audio = reference(pipe, params)
        diffs = float(np.abs(result.image - video).max()), float(np.abs(result.audio.samples - audio).max())
        print(f"{params.prompt!r} lora {params.lora}: max abs diff frames {diffs[0]:.1e}, waveform {diffs[1]:.1e}")
        assert max(diffs) <= TOLERANCE, (params.prompt, diffs)
        assert (float(np.abs(video - plain).max()) > 1e-2) == bool(params.lora)
