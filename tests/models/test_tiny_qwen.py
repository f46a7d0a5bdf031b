"""The tiny Z-Image and Qwen-Image checkpoints: their Qwen tokenizer survives a save and load, keeps listed words
whole, and cuts Qwen-Image's prompt template exactly where the pipeline cuts it; both load through the pipeline
classes' `from_pretrained` and generate."""

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, QwenImagePipeline, ZImagePipeline
from transformers import AutoTokenizer

from diffusiond.models.preview import load_preview_factors
from diffusiond.models.tiny.qwen import make_qwen_tokenizer
from diffusiond.models.tiny.text import WORDS

PROMPTS = ["a red circle on a blue background", "A zebraish Quokka, 42 times!", " leading space"]


def test_qwen_tokenizer_round_trip_and_single_words(tmp_path):
    built = make_qwen_tokenizer()
    built.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in [*PROMPTS, " ".join(WORDS)]:
        assert loaded(text)["input_ids"] == built(text)["input_ids"], text
        assert loaded.decode(loaded(text)["input_ids"]) == text
    for word in WORDS:
        assert len(built(word)["input_ids"]) == 1 and len(built(" " + word)["input_ids"]) == 1, word
    chat = [{"role": "user", "content": "a red circle"}]
    rendered = loaded.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\na red circle<|im_end|>\n<|im_start|>assistant\n"


def test_qwen_image_template_is_cut_where_the_pipeline_cuts(tiny_qwenimage):
    pipe = QwenImagePipeline.from_pretrained(tiny_qwenimage)
    template, start = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
    for prompt in PROMPTS:
        ids = pipe.tokenizer(template.format(prompt))["input_ids"]
        assert ids[start:] == pipe.tokenizer(prompt + template.split("{}")[1])["input_ids"], prompt


@pytest.mark.parametrize(("fixture", "cls"), [("tiny_zimage", ZImagePipeline), ("tiny_qwenimage", QwenImagePipeline)])
def test_loads_as_its_pipeline_and_generates(fixture, cls, request):
    checkpoint = request.getfixturevalue(fixture)
    pipe = DiffusionPipeline.from_pretrained(checkpoint)
    assert type(pipe) is cls
    pipe.set_progress_bar_config(disable=True)
    image = pipe(
        "a red circle",
        height=64,
        width=64,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images[0]
    assert image.shape == (64, 64, 3) and np.isfinite(image).all()
    assert image.std() > 0.01  # not a constant image


@pytest.mark.parametrize(("family", "channels"), [("z-image", 16), ("qwen-image", 16), ("qwen-image-21", 64)])
def test_make_tiny_writes_a_preview_map_fitted_through_the_familys_decode(family, channels, tmp_path):
    """`diffusiond make-tiny` for these families: Qwen-Image's VAE is a video VAE (5-D latents, its own
    normalisation), which the generic AutoencoderKL fit cannot load; Qwen-Image 2.1's decodes RGBA (the map is
    fitted to its colour channels)."""
    from diffusiond.daemon.cli import main

    assert main(["make-tiny", "--family", family, "--out", str(tmp_path)]) == 0
    fitted = load_preview_factors(tmp_path)
    assert fitted is not None and fitted.source == "fitted" and len(fitted.factors) == channels
    assert all(len(row) == 3 for row in fitted.factors)


def test_tiny_qwen_image_21_loads_as_its_pipeline_and_follows_its_inputs(tmp_path):
    """The tiny Qwen-Image 2.1 (models/tiny/qwen21.py, `make-tiny --family qwen-image-21`): saved and loaded back
    through `QwenImage21Pipeline.from_pretrained`, it generates RGBA 64x64 images in which another prompt, true CFG
    with a negative prompt, and another condition image each clearly show (random weights alone hid them: <= 0.005)."""
    from diffusers import QwenImage21Pipeline
    from PIL import Image

    from diffusiond.models.tiny.qwen21 import build_qwenimage21

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        build_qwenimage21().save_pretrained(tmp_path)
    pipe = QwenImage21Pipeline.from_pretrained(tmp_path)
    pipe.set_progress_bar_config(disable=True)

    def run(prompt="a red circle", **more):
        generator = torch.Generator().manual_seed(1)
        kwargs = dict(height=64, width=64, num_inference_steps=3, generator=generator, output_type="np")
        return pipe(prompt=prompt, **kwargs, **more).images[0]

    image = run()
    assert image.shape == (64, 64, 4)
    assert np.abs(run("a green box on the grass") - image).max() > 0.01
    assert np.abs(run(negative_prompt="blurry", true_cfg_scale=4.0) - image).max() > 0.01
    red, blue = (Image.new("RGB", (64, 64), c) for c in ("red", "blue"))
    assert np.abs(run(image=red, output_resolution=64) - run(image=blue, output_resolution=64)).max() > 0.01
