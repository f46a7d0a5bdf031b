"""The tiny LTX-2 checkpoints (models/tiny/ltx2.py), groundwork for the LTX-2 family (issue 32, item 6)."""

import numpy as np
import torch


def test_tiny_ltx2_loads_as_its_pipelines_and_follows_its_inputs(tmp_path):
    """The tiny LTX-2 (models/tiny/ltx2.py, for the coming adapter): text- and image-to-video with sound, saved and
    loaded back through `LTX2Pipeline.from_pretrained`; a prompt and a seed move both the frames and the waveform
    (random weights alone hid the prompt: 0.0035 of the frames, and gave a constant waveform), and the
    image-to-video pipeline takes the same components and follows its image."""
    from diffusers import LTX2ImageToVideoPipeline, LTX2Pipeline
    from PIL import Image

    from diffusiond.models.tiny.ltx2 import build_ltx2

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        build_ltx2().save_pretrained(tmp_path)
    pipe = LTX2Pipeline.from_pretrained(tmp_path)
    pipe.set_progress_bar_config(disable=True)

    def run(pipe, prompt="a red cat walking", seed=0, **more):
        generator = torch.Generator().manual_seed(seed)
        kwargs = dict(height=64, width=64, num_frames=9, num_inference_steps=3, generator=generator)
        video, audio = pipe(prompt=prompt, **kwargs, **more, output_type="np", return_dict=False)
        return video[0], np.asarray(audio[0])

    video, audio = run(pipe)
    assert video.shape == (9, 64, 64, 3) and audio.shape[0] == 2 and np.abs(audio).std() > 0
    for other in (run(pipe, "a blue dog on the grass"), run(pipe, seed=1)):
        assert np.abs(other[0] - video).max() > 0.01 and np.abs(other[1] - audio).max() > 0.01
    i2v = LTX2ImageToVideoPipeline.from_pipe(pipe)
    red, blue = (Image.new("RGB", (64, 64), c) for c in ("red", "blue"))
    assert np.abs(run(i2v, image=red)[0] - run(i2v, image=blue)[0]).max() > 0.01
