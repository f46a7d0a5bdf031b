"""The shipped demo model (models/demo): scene grammar, judge, and the checkpoint served through the normal loader."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from diffusiond.engine.engine import Engine
from diffusiond.engine.outputs import Completed
from diffusiond.models.declared import DEFAULTS_FILE
from diffusiond.models.default import SHIPPED, default_model
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import SamplingParams
from diffusiond.models.preview import decode_pooled, load_preview_factors
from diffusiond.tools.demo import scenes as sc
from diffusiond.tools.demo.evaluate import SEED_BASE, eval_scenes
from diffusiond.tools.demo.judge import ATTRIBUTES, accuracy, analyse, judge
from diffusiond.tools.demo.text import CLIP_MAX_LENGTH, make_tokenizer
from diffusiond.tools.demo.train import check_zero_token_trick, image_batch

# Held-out captions (never trained on) served at the checkpoint's defaults, with evaluate.py's order and seeds.
SERVE_PROMPTS = 8
# Least right answers out of SERVE_PROMPTS. Measured on the shipped weights (v2) for these prompts: 8/8 on every
# attribute (over all 162 held-out prompts: colour 98.1%, background 90.7%, position 98.8%, shape 92.0%; README.md).
# A model that ignores the prompt gets about 1/6 of the colours, 1/9 of the positions and 1/3 of the shapes right.
MIN_RIGHT = {"colour": 7, "background": 7, "position": 7, "shape": 5}
# Preview map RMSE / RMSE of the flat mean colour, on real scene latents against their pooled decodes: measured 0.14
# (0.28 with a per-pixel map alone, before the image's mean latent was an input).
PREVIEW_RATIO_BOUND = 0.2
# Preview colour error (of 255) on flat regions of held-out scenes, per colour: measured 5.6-9.0 (13-26 before).
PREVIEW_COLOUR_BOUND = 12.0


def _mutations(scene: sc.Scene) -> dict[str, sc.Scene]:
    """For each attribute, the same scene with only that attribute changed (colours kept distinct)."""
    colours = [c for c in sc.COLOURS if c not in (scene.colour, scene.background)]
    return {
        "background": replace(scene, background=colours[0]),
        "colour": replace(scene, colour=colours[1]),
        "shape": replace(scene, shape=next(s for s in sc.SHAPES if s != scene.shape)),
        "position": replace(scene, position=next(p for p in sc.POSITIONS if p != scene.position)),
        "size": replace(scene, size=next(s for s in sc.SIZES if s != scene.size)),
    }


def test_captions_round_trip_and_split() -> None:
    scenes = sc.all_scenes()
    assert len(scenes) == len(sc.SHAPES) * len(sc.COLOURS) * (len(sc.COLOURS) - 1) * len(sc.SIZES) * len(sc.POSITIONS)
    assert len({s.caption for s in scenes}) == len(scenes)
    for s in scenes[::37]:
        assert sc.parse_caption(s.caption) == s
    train, held_out = sc.split()
    assert not set(train) & set(held_out)
    assert len(held_out) == round(len(scenes) * sc.HELD_OUT_FRACTION)
    assert sc.split() == (train, held_out)  # fixed
    with pytest.raises(ValueError):
        sc.parse_caption("a photo of a cat")


def test_tokenizer_has_one_token_per_word() -> None:
    tok = make_tokenizer()
    assert tok.model_max_length == CLIP_MAX_LENGTH
    for s in sc.all_scenes()[::11]:
        ids = tok(s.caption)["input_ids"]
        assert len(ids) == len(s.caption.split()) + 2 <= CLIP_MAX_LENGTH


def test_judge_accepts_ground_truth() -> None:
    rng = np.random.default_rng(0)
    scenes = [sc.random_scene(rng) for _ in range(200)]
    images = [sc.render(s, rng) for s in scenes]
    acc = accuracy(zip(scenes, images, strict=True))
    for name in ATTRIBUTES:
        assert acc[name] >= 0.98, acc
    # Float images in [0, 1] and captions (not Scene objects) are judged the same way.
    assert judge(scenes[0].caption, images[0].astype(np.float32) / 255).all


def test_judge_rejects_wrong_scenes() -> None:
    rng = np.random.default_rng(1)
    for _ in range(40):
        scene = sc.random_scene(rng)
        image = sc.render(scene, rng)
        assert judge(scene, image).all
        for attribute, wrong in _mutations(scene).items():
            verdict = judge(wrong.caption, image).as_dict()
            assert not verdict[attribute], (scene, attribute)
            assert all(ok for name, ok in verdict.items() if name != attribute), (scene, attribute, verdict)


def test_judge_finds_no_shape_in_a_plain_image() -> None:
    image = np.full((64, 64, 3), sc.COLOURS["blue"], dtype=np.uint8)
    seen = analyse(image)
    assert seen.background == "blue" and seen.shape is None and seen.colour is None
    verdict = judge("a small red circle in the center on a blue background", image)
    assert verdict.background and not (verdict.colour or verdict.shape or verdict.position or verdict.size)


# --------------------------------------------------------------------------------------------------- the model


@pytest.fixture(scope="module")
def adapter():
    return load_adapter(default_model())


def test_default_model_is_the_shipped_checkpoint() -> None:
    assert Path(default_model()) == SHIPPED
    index = json.loads((SHIPPED / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert index["text_encoder_3"] == [None, None] and index["tokenizer_3"] == [None, None]
    weights = sum(p.stat().st_size for p in SHIPPED.rglob("*.safetensors"))
    assert weights < 30e6


def test_checkpoint_defaults_are_served(adapter) -> None:
    shipped = json.loads((SHIPPED / DEFAULTS_FILE).read_text())
    caps = adapter.capabilities
    assert caps.family == "sd3"
    assert (caps.default_width, caps.default_height) == (shipped["width"], shipped["height"]) == (64, 64)
    assert caps.default_steps == shipped["num_inference_steps"]
    assert caps.default_guidance == shipped["guidance_scale"]
    assert adapter.pipe.text_encoder_3 is None and adapter.pipe.tokenizer_3 is None
    assert adapter.vae_scale_factor == 4


def test_preview_map_is_the_fitted_one(adapter) -> None:
    fitted = load_preview_factors(SHIPPED)
    assert fitted is not None and fitted.channels == adapter.vae.config.latent_channels == 8
    assert adapter.latent_rgb == fitted
    # It explains most of what the decoder makes of real latents (scenes never trained on).
    vae = adapter.vae
    x = image_batch(np.random.default_rng(5), sc.split()[1], 16)
    with torch.no_grad():
        z = (vae.encode(x).latent_dist.mean - vae.config.shift_factor) * vae.config.scaling_factor
    target = decode_pooled(vae, z)  # [N, 3, 16, 16]
    pred = fitted.to_float(z).permute(0, 3, 1, 2)
    flat = target.mean(dim=(0, 2, 3), keepdim=True)
    ratio = float((pred - target).pow(2).mean().sqrt() / (flat - target).pow(2).mean().sqrt())
    assert ratio < PREVIEW_RATIO_BOUND, ratio


def test_previews_show_the_colours_the_image_will_have(adapter) -> None:
    from diffusiond.tools.demo.previewfit import colour_error

    errors = colour_error(adapter.vae, load_preview_factors(SHIPPED), sc.split()[1])
    assert set(errors) == set(sc.COLOURS)
    assert all(e < PREVIEW_COLOUR_BOUND for e in errors.values()), errors


def test_one_zero_token_trains_as_256(adapter) -> None:
    """Training stands one zero token (logit + log 256) for the pipeline's 256 zero tokens: same outputs."""
    prompts = [s.caption for s in sc.split()[1][:2]] + [""]
    assert check_zero_token_trick(adapter.pipe, prompts) < 1e-4


async def _serve(adapter, prompts: list[str]) -> list[np.ndarray]:
    engine = Engine(adapter, max_batch=min(len(prompts), 32), max_waiting=len(prompts))
    await engine.start()
    try:
        handles = [
            engine.add_request(SamplingParams(prompt=p, seed=SEED_BASE + i)) for i, p in enumerate(prompts)
        ]  # every other parameter from the checkpoint's defaults
        results = await asyncio.gather(*(h.result() for h in handles))
    finally:
        await engine.stop()
    assert all(isinstance(r, Completed) for r in results), results
    return [r.image for r in results]


def _pipeline() -> StableDiffusion3Pipeline:
    """diffusers' own pipeline for the shipped folder (passing the null T5 components again, as diffusers 0.42
    needs)."""
    pipe = StableDiffusion3Pipeline.from_pretrained(SHIPPED, dtype=torch.float32, text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _at_defaults(adapter, prompt: str) -> SamplingParams:
    """`_serve`'s request for the first prompt, resolved as the pipeline is called: the checkpoint's defaults."""
    caps = adapter.capabilities
    return SamplingParams(
        prompt=prompt,
        seed=SEED_BASE,
        num_inference_steps=caps.default_steps,
        guidance_scale=caps.default_guidance,
        height=caps.default_height,
        width=caps.default_width,
    )


def test_diffusers_pipeline_draws_the_same_image(adapter) -> None:
    """diffusers' own pipeline loads the folder (passing the null T5 components again, as diffusers 0.42 needs)
    and generates what the engine serves, also for a request served in a batch with others. The scheduler is
    stochastic (fresh noise at every step): the reference threads the call's generator into `scheduler.step`, as
    diffusiond draws that noise from each request's own generator."""
    from engines import reference

    pipe = _pipeline()
    assert pipe.scheduler.config.stochastic_sampling
    prompts = [s.caption for s in eval_scenes(3)]
    expected = reference(pipe, "sd3", _at_defaults(adapter, prompts[0]))
    (alone,) = asyncio.run(_serve(adapter, prompts[:1]))
    batched = asyncio.run(_serve(adapter, prompts))
    assert np.abs(alone - expected).max() < 1e-4
    assert np.abs(batched[0] - expected).max() < 1e-4


def test_serves_prompts_it_was_never_trained_on(adapter) -> None:
    scenes = eval_scenes(SERVE_PROMPTS)
    images = asyncio.run(_serve(adapter, [s.caption for s in scenes]))
    assert all(img.shape == (64, 64, 3) for img in images)
    verdicts = [judge(s, img) for s, img in zip(scenes, images, strict=True)]
    right = {name: sum(getattr(v, name) for v in verdicts) for name in MIN_RIGHT}
    assert all(right[name] >= least for name, least in MIN_RIGHT.items()), (right, [v.seen for v in verdicts])


def test_caption_variants_name_exactly_what_they_say() -> None:
    """Every caption `describe` writes uses known words only, fits the tokenizer, and names an attribute exactly
    when it says it does (with any of its synonyms)."""
    from diffusiond.models.declared import unknown_words

    tok = make_tokenizer()
    vocabulary = frozenset(sc.VOCABULARY)
    rng = np.random.default_rng(3)
    train = sc.split()[0]
    seen_words: set[str] = set()
    for i in range(3000):
        scene = train[(i * 7) % len(train)]
        caption = sc.describe(scene, rng, held_out=None)
        words = sc.tokens(caption.text)
        seen_words |= set(words)
        assert unknown_words(vocabulary, caption.text) == [], caption
        assert tok(caption.text)["input_ids"][1:-1] == tok.convert_tokens_to_ids([w + "</w>" for w in words])
        assert len(words) <= sc.MAX_CAPTION_TOKENS
        assert (scene.colour in words) == ("colour" in caption.named), caption
        assert (scene.background in words) == ("background" in caption.named), caption
        for attribute in ("shape", "size"):
            synonyms = set(sc.SYNONYMS[getattr(scene, attribute)])
            assert bool(synonyms & set(words)) == (attribute in caption.named), caption
    assert seen_words >= set(sc.VOCABULARY)  # training uses every word it declares


def test_held_out_phrasings_are_never_trained_on() -> None:
    """A tenth of the phrasings is held out; training draws never produce one, the evaluation only those; captions
    in the grammar's own words are always trained."""
    from diffusiond.tools.demo.evaluate import caption_cases

    rng = np.random.default_rng(4)
    train = sc.split()[0]
    drawn = [sc.describe(train[i % len(train)], rng, held_out=None) for i in range(4000)]
    share = np.mean([c.held_out for c in drawn])
    assert 0.07 < share < 0.13, share
    trained = {repr(c.phrasing) for c in (sc.describe(train[i % len(train)], rng) for i in range(4000))}
    evaluated = [c for kind in ("full", "partial") for _, c in caption_cases(kind, 40, 2)]
    assert all(c.held_out for c in evaluated)
    assert not trained & {repr(c.phrasing) for c in evaluated}
    assert all(0 < len(c.named) < 5 for _, c in caption_cases("partial", 40, 2))
    grammar = sc.describe(train[0], rng, named=sc.ATTRIBUTE_ORDER)
    while grammar.text != train[0].caption:
        grammar = sc.describe(train[0], rng, named=sc.ATTRIBUTE_ORDER)
    assert not grammar.held_out and not sc.phrasing_held_out(grammar.phrasing)


# Partial captions in held-out phrasings of held-out scenes (evaluate.caption_cases: one for each of the 162 held-out
# scenes), served at the defaults: the attributes a caption names must be drawn. Bounds are the least fraction right
# of the captions that name each attribute (76-105 of these 162). Colour and shape are issue 12's targets; the
# shipped weights (v3, stochastic sampling) draw colour 96.1%, background 100%, shape 93.1%, position 100%, size
# 96.5% here; on four captions a scene (648, `evaluate partial`, 4 minutes of this suite before it took one) 96.8%,
# 99.4%, 91.9%, 100%, 93.6%, and 95.7%, 98.9%, 92.6%, 99.7%, 93.0% on 648 other captions of the same scenes with
# other seeds (`evaluate partial --seed-base 5000`). Sampled without the scheduler's fresh noise (`--no-stochastic`),
# the same weights draw shape 88.0% on the 648, and v2 drew colour 89.0%, shape 79.5% (tools/demo/README.md). A model
# that ignores the prompt gets about 1/6 of colours and backgrounds, 1/3 of shapes and 1/2 of sizes, 1/9 of positions.
MIN_PARTIAL = {"colour": 0.95, "background": 0.95, "shape": 0.90, "position": 0.95, "size": 0.9}


def test_follows_partial_captions_it_was_never_trained_on(adapter) -> None:
    from diffusiond.tools.demo.evaluate import caption_cases, judge_named

    cases = caption_cases("partial", len(sc.split()[1]), 1)
    images = asyncio.run(_serve(adapter, [c.text for _, c in cases]))
    got = judge_named(cases, images)
    assert all(got[name] >= least for name, least in MIN_PARTIAL.items()), (got, MIN_PARTIAL)


def test_scheduler_config_changes_the_sampler_at_load(adapter) -> None:
    """`--scheduler-config` (load_adapter's `scheduler_config`): the bundled model sampled without fresh noise at
    each step, as diffusers' pipeline draws it with the same change; a setting the scheduler lacks is refused by
    name."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from engines import reference

    plain = load_adapter(default_model(), scheduler_config={"stochastic_sampling": False})
    assert type(plain.pipe.scheduler) is type(adapter.pipe.scheduler)
    assert not plain.pipe.scheduler.config.stochastic_sampling and adapter.pipe.scheduler.config.stochastic_sampling
    assert plain.pipe.scheduler.config.shift == adapter.pipe.scheduler.config.shift  # the rest as shipped
    pipe = _pipeline()
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, stochastic_sampling=False)
    prompt = eval_scenes(1)[0].caption
    (image,) = asyncio.run(_serve(plain, [prompt]))
    assert np.abs(image - reference(pipe, "sd3", _at_defaults(adapter, prompt))).max() < 1e-4
    (stochastic,) = asyncio.run(_serve(adapter, [prompt]))
    assert np.abs(image - stochastic).max() > 0.05  # the change took effect
    with pytest.raises(ValueError, match=r"has no setting 'stochastic'; it has: .*stochastic_sampling"):
        load_adapter(default_model(), scheduler_config={"stochastic": False})


def test_step_cache_on_a_stochastic_scheduler_warns(serve, caplog) -> None:
    """The bundled model's fresh noise at every step leaves a step cache nothing to reuse: the start says so, and
    how to sample deterministically."""
    with caplog.at_level("WARNING", logger="diffusiond"):
        serve(model=str(SHIPPED), cache="teacache")
        serve(model=str(SHIPPED), cache="teacache", scheduler_config='{"stochastic_sampling": false}')
    warned = [r.getMessage() for r in caplog.records if "stochastic_sampling" in r.getMessage()]
    assert len(warned) == 1 and "--scheduler-config" in warned[0], warned
