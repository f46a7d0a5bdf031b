"""The tiny HunyuanVideo-1.5 checkpoints (models/tiny/hunyuan15.py), groundwork for the HunyuanVideo-1.5 family."""

import numpy as np
import torch


def test_tiny_hunyuan_video15_loads_as_its_pipelines_and_follows_its_inputs(tmp_path):
    """The tiny HunyuanVideo-1.5 (models/tiny/hunyuan15.py): text- and image-to-video, saved and loaded back through
    the pipelines' `from_pretrained` (the loaded text-to-video pipeline makes the very frames the built one does); a
    prompt, a quoted glyph text (the ByT5 encoder), a seed and the guider's scale move the frames (random weights
    alone hid the prompt: 0.026 of the frames), and the image-to-video pipeline follows its image and its prompt."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline
    from PIL import Image

    from diffusiond.models.tiny.hunyuan15 import build_hunyuan_video15, build_hunyuan_video15_i2v

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        built = build_hunyuan_video15()
        built.save_pretrained(tmp_path / "t2v")
        build_hunyuan_video15_i2v().save_pretrained(tmp_path / "i2v")
    pipe = HunyuanVideo15Pipeline.from_pretrained(tmp_path / "t2v")
    i2v = HunyuanVideo15ImageToVideoPipeline.from_pretrained(tmp_path / "i2v")
    for p in (built, pipe, i2v):
        p.set_progress_bar_config(disable=True)

    def run(pipe, prompt="a red cat walking", seed=0, **more):
        generator = torch.Generator().manual_seed(seed)
        size = {} if "image" in more else {"height": 64, "width": 64}  # i2v: the image's bucket at target_size 64
        kwargs = dict(num_frames=9, num_inference_steps=3, generator=generator, output_type="np", return_dict=False)
        return pipe(prompt=prompt, **size, **kwargs, **more)[0][0]

    video = run(pipe)
    assert video.shape == (9, 64, 64, 3) and video.min() >= 0 and video.max() <= 1 and video.std() > 0.05
    assert np.abs(run(built) - video).max() == 0
    for other in (run(pipe, "a blue dog on the grass"), run(pipe, 'a red cat walking "hello"'), run(pipe, seed=1)):
        assert np.abs(other - video).max() > 0.01
    pipe.guider = pipe.guider.new(guidance_scale=3.0)  # the checkpoint's guider: 6.0
    assert np.abs(run(pipe) - video).max() > 0.01

    red, blue = (Image.new("RGB", (64, 64), c) for c in ("red", "blue"))
    first = run(i2v, image=red)
    assert first.shape == (9, 64, 64, 3)
    for other in (run(i2v, image=blue), run(i2v, "a blue dog on the grass", image=red)):
        assert np.abs(other - first).max() > 0.01
