"""The requests of the SPMD tests (tests/engine/test_spmd.py), per family, and the fixture of each family's tiny
checkpoint: staggered requests that differ in prompt, seed, steps and guidance, some with CFG and some without (so
that CFG-parallel splits both rows and requests), and each family's image inputs.

On the test path through `pythonpath = ["tests"]` in pyproject.toml: `from spmd_requests import ...`.
"""

import msgspec
from pictures import mask, picture

from diffusiond.models.params import SamplingParams


def edit(**fields) -> SamplingParams:
    """An edit, one per family: its file crosses the wire once and every rank encodes it the same."""
    base = {
        "prompt": "an edit",
        "image": picture(80, 64, seed=1),
        "strength": 0.7,
        "seed": 6,
        "width": 64,
        "height": 64,
        "num_inference_steps": 4,
    }
    return SamplingParams(**{**base, **fields})


REQUESTS = {
    "sd3": [
        SamplingParams(prompt="a red circle", seed=1, width=64, height=64, num_inference_steps=4, guidance_scale=5.0),
        SamplingParams(
            prompt="a blue square",
            negative_prompt="blurry",
            seed=2,
            width=64,
            height=64,
            num_inference_steps=3,
            guidance_scale=3.0,
        ),
        # 48x48: 9 image tokens, not divisible by 2, so Ulysses shards unevenly.
        SamplingParams(prompt="a cat", seed=3, width=48, height=48, num_inference_steps=3, guidance_scale=4.0),
        # Three without CFG finishing together: CFG-parallel splits them 2 + 1 between the ranks, and the ranks
        # share their decoding.
        *(
            SamplingParams(
                prompt=f"no guidance {i}", seed=4 + i, width=64, height=64, num_inference_steps=2, guidance_scale=1.0
            )
            for i in range(3)
        ),
        # A plan larger than the 4 KiB broadcast buffer: its tail follows in a second broadcast.
        SamplingParams(
            prompt="a red circle " * 500, seed=5, width=64, height=64, num_inference_steps=2, guidance_scale=5.0
        ),
        # Inpainting: the mask crosses the wire with its image; every rank pins the same region.
        edit(guidance_scale=5.0, mask=mask(80, 64, (0, 0, 40, 32), alpha=True)[0]),
    ],
    "flux": [
        SamplingParams(prompt="a red circle", seed=1, width=64, height=64, num_inference_steps=4, guidance_scale=3.5),
        SamplingParams(
            prompt="a dog",
            negative_prompt="blurry",
            seed=2,
            width=64,
            height=64,
            num_inference_steps=3,
            guidance_scale=3.5,
            true_cfg_scale=3.0,
        ),
        SamplingParams(
            prompt="a cat",
            negative_prompt="dark",
            seed=3,
            width=48,
            height=48,
            num_inference_steps=3,
            guidance_scale=2.0,
            true_cfg_scale=2.0,
        ),
        # Without true CFG, finishing together: split between the ranks and decoded by both.
        *(
            SamplingParams(
                prompt=f"plain {i}", seed=10 + i, width=64, height=64, num_inference_steps=2, guidance_scale=3.5
            )
            for i in range(2)
        ),
        edit(
            negative_prompt="dark",
            image=picture(64, 96, seed=2, fmt="JPEG"),
            mask=mask(64, 96, (16, 16, 48, 80))[0],
            strength=0.8,
            guidance_scale=3.5,
            true_cfg_scale=2.0,
        ),
    ],
    "sdxl": [
        SamplingParams(prompt="a red circle", seed=1, width=64, height=64, num_inference_steps=4, guidance_scale=5.0),
        SamplingParams(
            prompt="a blue square",
            negative_prompt="blurry",
            seed=2,
            width=64,
            height=64,
            num_inference_steps=3,
            guidance_scale=3.0,
        ),
        SamplingParams(prompt="a cat", seed=3, width=56, height=72, num_inference_steps=3, guidance_scale=4.0),
        # Without CFG, finishing together: split between the ranks and decoded by both.
        *(
            SamplingParams(
                prompt=f"plain {i}", seed=10 + i, width=64, height=64, num_inference_steps=2, guidance_scale=1.0
            )
            for i in range(3)
        ),
    ],
    "flux2-klein": [
        SamplingParams(prompt="a red circle", seed=1, width=64, height=64, num_inference_steps=4, guidance_scale=4.0),
        SamplingParams(
            prompt="a blue square",
            negative_prompt="blurry",
            seed=2,
            width=64,
            height=64,
            num_inference_steps=3,
            guidance_scale=3.0,
        ),
        SamplingParams(prompt="a cat", seed=3, width=48, height=48, num_inference_steps=3, guidance_scale=4.0),
        # Without CFG, finishing together: split between the ranks and decoded by both.
        *(
            SamplingParams(
                prompt=f"plain {i}", seed=10 + i, width=64, height=64, num_inference_steps=2, guidance_scale=1.0
            )
            for i in range(3)
        ),
        edit(prompt="make it red", strength=None, guidance_scale=4.0),  # a reference edit, with CFG
    ],
    # Instruction edits: the image's tokens join every forward's sequence (CFG rows; Ulysses shards them too). At
    # the context scaled to the output (`edit_context: "output"`): at the pipeline's ~1 Mpx context (4,096 tokens
    # beside 16) the ranks' fp32 sums in another order differ by up to 1.4e-4, past TOLERANCE; the split is the same.
    "flux-kontext": [
        SamplingParams(
            prompt="a dog",
            negative_prompt="blurry",
            seed=2,
            width=64,
            height=64,
            num_inference_steps=3,
            true_cfg_scale=3.0,
        ),
        edit(
            prompt="make it dark",
            negative_prompt="bright",
            image=picture(64, 96, seed=2, fmt="JPEG"),
            strength=None,
            num_inference_steps=3,
            true_cfg_scale=2.0,
            edit_context="output",
        ),
        # Without true CFG, finishing together: split between the ranks and decoded by both.
        *(
            edit(
                prompt=f"plain edit {i}",
                image=picture(80, 64, seed=i),
                strength=None,
                seed=10 + i,
                num_inference_steps=2,
                edit_context="output",
            )
            for i in range(2)
        ),
    ],
    # FLUX.2 [dev] is guidance-distilled: never a CFG row; CFG-parallel splits requests only. An edit with a
    # reference image among them.
    "flux2": [
        SamplingParams(prompt="a red circle", seed=1, width=64, height=64, num_inference_steps=4, guidance_scale=4.0),
        SamplingParams(
            prompt="put the cat on the sofa",
            image=picture(80, 64, seed=1),
            reference_images=(picture(64, 64, seed=2),),
            seed=2,
            width=64,
            height=64,
            num_inference_steps=3,
            guidance_scale=3.0,
        ),
        SamplingParams(prompt="a cat", seed=3, width=48, height=48, num_inference_steps=3, guidance_scale=5.0),
        *(
            SamplingParams(
                prompt=f"plain {i}", seed=10 + i, width=64, height=64, num_inference_steps=2, guidance_scale=2.0 + i
            )
            for i in range(3)
        ),
    ],
    # Qwen-Image 2.1: rows share a call when their texts have one layout; these prompts (and negatives) have one
    # length each, so every rank makes one call per step.
    "qwen-image-21": [
        *(
            SamplingParams(
                prompt=prompt,
                negative_prompt="blurry",
                true_cfg_scale=scale,
                seed=i + 1,
                width=64,
                height=64,
                num_inference_steps=4 - (i > 0),
            )
            for i, (prompt, scale) in enumerate((("a red circle", 4.0), ("a red square", 2.5), ("a green box", 3.0)))
        ),
        *(
            SamplingParams(prompt=f"plain {i}", seed=10 + i, width=64, height=64, num_inference_steps=2)
            for i in range(3)
        ),
    ],
    "z-image": [
        SamplingParams(prompt="a red circle", seed=1, width=64, height=64, num_inference_steps=4, guidance_scale=4.0),
        SamplingParams(
            prompt="a blue square on the grass",
            negative_prompt="blurry",
            seed=2,
            width=64,
            height=64,
            num_inference_steps=3,
            guidance_scale=3.0,
        ),
        SamplingParams(prompt="a cat", seed=3, width=48, height=48, num_inference_steps=3, guidance_scale=4.0),
        # Guidance 0 (Turbo), finishing together: split between the ranks and decoded by both.
        *(
            SamplingParams(
                prompt=f"plain {i}", seed=10 + i, width=64, height=64, num_inference_steps=2, guidance_scale=0.0
            )
            for i in range(3)
        ),
        edit(guidance_scale=4.0),
    ],
    "qwen-image": [
        SamplingParams(
            prompt="a red circle", negative_prompt="blurry", seed=1, width=64, height=64, num_inference_steps=4
        ),
        SamplingParams(
            prompt="a blue square on the grass",
            negative_prompt="dark",
            seed=2,
            width=64,
            height=64,
            num_inference_steps=3,
            true_cfg_scale=2.5,
        ),
        SamplingParams(
            prompt="a cat", negative_prompt="", seed=3, width=48, height=48, num_inference_steps=3, true_cfg_scale=4.0
        ),
        # No negative prompt, no true CFG, finishing together: split between the ranks and decoded by both.
        *(
            SamplingParams(prompt=f"plain {i}", seed=10 + i, width=64, height=64, num_inference_steps=2)
            for i in range(3)
        ),
        edit(negative_prompt="dark"),
    ],
    # 80x48 with 9 frames: 3 x 3 x 5 = 45 tokens, which Ulysses shards unevenly.
    "wan": [
        SamplingParams(
            prompt="a red cat", seed=1, width=80, height=48, num_frames=9, num_inference_steps=4, guidance_scale=5.0
        ),
        SamplingParams(
            prompt="a blue dog",
            negative_prompt="blurry",
            seed=2,
            width=48,
            height=32,
            num_frames=5,
            num_inference_steps=3,
            guidance_scale=3.0,
        ),
        *(
            SamplingParams(
                prompt=f"plain {i}",
                seed=10 + i,
                width=48,
                height=32,
                num_frames=5,
                num_inference_steps=2,
                guidance_scale=1.0,
            )
            for i in range(3)
        ),
    ],
    # Qwen-Image-Edit-Plus: edits of one and two images, the prompts read beside them on rank 0 and shared.
    "qwen-image-edit-plus": [
        edit(
            prompt="make it red",
            strength=None,
            negative_prompt="blurry",
            true_cfg_scale=3.0,
            num_inference_steps=3,
            reference_images=(picture(64, 64, seed=5),),
        ),
        *(
            edit(
                prompt=f"plain edit {i}",
                image=picture(80, 64, seed=i),
                strength=None,
                seed=10 + i,
                num_inference_steps=2,
            )
            for i in range(3)
        ),
    ],
    # Wan 2.2 A14B: started together, the first two sit on both sides of the boundary at their second step (900 and
    # 857 of 1000, boundary 875): that step runs both experts, each on its request's rows.
    "wan22": [
        SamplingParams(
            prompt="a red cat",
            seed=1,
            width=48,
            height=32,
            num_frames=5,
            num_inference_steps=4,
            guidance_scale=5.0,
            guidance_scale_2=3.0,
        ),
        SamplingParams(
            prompt="a blue dog",
            negative_prompt="blurry",
            seed=2,
            width=48,
            height=32,
            num_frames=5,
            num_inference_steps=3,
            guidance_scale=3.0,
        ),
        *(
            SamplingParams(
                prompt=f"plain {i}",
                seed=10 + i,
                width=48,
                height=32,
                num_frames=5,
                num_inference_steps=2,
                guidance_scale=1.0,
            )
            for i in range(3)
        ),
    ],
    # Wan 2.2 TI2V-5B: a timestep (and modulation) per token, sharded with the tokens under Ulysses; text- and
    # image-to-video requests share forwards.
    "wan22-ti2v": [
        SamplingParams(
            prompt="a red cat", seed=1, width=96, height=64, num_frames=9, num_inference_steps=3, guidance_scale=5.0
        ),
        SamplingParams(
            prompt="a blue dog",
            negative_prompt="blurry",
            seed=2,
            width=96,
            height=64,
            num_frames=9,
            num_inference_steps=3,
            guidance_scale=3.0,
            image=picture(96, 64, seed=2),
        ),
        *(
            SamplingParams(
                prompt=f"plain {i}",
                seed=10 + i,
                width=64,
                height=32,
                num_frames=5,
                num_inference_steps=2,
                guidance_scale=1.0,
                image=picture(64, 32, seed=i) if i else None,
            )
            for i in range(3)
        ),
    ],
    "wan-i2v": [
        SamplingParams(
            prompt="a red cat",
            seed=1,
            width=80,
            height=48,
            num_frames=9,
            num_inference_steps=3,
            guidance_scale=5.0,
            image=picture(80, 48, seed=1),
        ),
        *(
            SamplingParams(
                prompt=f"plain {i}",
                seed=10 + i,
                width=48,
                height=32,
                num_frames=5,
                num_inference_steps=2,
                guidance_scale=1.0,
                image=picture(48, 32, seed=i),
            )
            for i in range(3)
        ),
    ],
    # HunyuanVideo-1.5: the requests with CFG at one size and those without at another, so that each batch is of
    # one kind (the check counts two rows per request of a CFG batch); 48x48 x 9 frames: 27 tokens, an uneven split.
    "hunyuan-video-15": [
        SamplingParams(
            prompt="a red cat", seed=1, width=64, height=64, num_frames=9, num_inference_steps=4, guidance_scale=6.0
        ),
        SamplingParams(
            prompt='a sign that says "hello"',
            negative_prompt="blurry",
            seed=2,
            width=64,
            height=64,
            num_frames=9,
            num_inference_steps=3,
            guidance_scale=3.0,
        ),
        *(
            SamplingParams(
                prompt=f"plain {i}" * (i + 1),
                seed=10 + i,
                width=48,
                height=48,
                num_frames=9,
                num_inference_steps=2,
                guidance_scale=1.0,
            )
            for i in range(3)
        ),
    ],
}
REQUESTS["ovis-image"] = [
    SamplingParams(prompt="a red circle", seed=1, width=64, height=64, num_inference_steps=4, guidance_scale=4.0),
    SamplingParams(
        prompt="a blue square on the grass",
        negative_prompt="blurry",
        seed=2,
        width=64,
        height=64,
        num_inference_steps=3,
        guidance_scale=3.0,
    ),
    SamplingParams(prompt="a cat", seed=3, width=48, height=48, num_inference_steps=3, guidance_scale=5.0),
    # Guidance 1 (no CFG), finishing together: split between the ranks and decoded by both.
    *(
        SamplingParams(prompt=f"plain {i}", seed=10 + i, width=64, height=64, num_inference_steps=2, guidance_scale=1.0)
        for i in range(3)
    ),
]
# LongCat-Image: its rewrite (on by default) runs on rank 0 with the other encodings; off where a prompt must matter.
REQUESTS["longcat-image"] = [
    msgspec.structs.replace(p, arguments={"enable_prompt_rewrite": i > 0}) for i, p in enumerate(REQUESTS["ovis-image"])
]
# GLM-Image: the prior's tokens sampled on rank 0 with the glyphs and shared; glyphs of three lengths (quoted text),
# so a step runs a call per length on each rank; guidance 1 on three finishing together.
REQUESTS["glm-image"] = [
    SamplingParams(prompt="a red circle", seed=1, width=64, height=64, num_inference_steps=4, guidance_scale=4.0),
    SamplingParams(prompt="a sign that says 'open'", seed=2, width=64, height=64, num_inference_steps=3),
    SamplingParams(prompt='a "cat" on a hill', seed=3, width=96, height=64, num_inference_steps=3, guidance_scale=5.0),
    *(
        SamplingParams(prompt=f"plain {i}", seed=10 + i, width=64, height=64, num_inference_steps=2, guidance_scale=1.0)
        for i in range(3)
    ),
]
# Stable Audio Open: sound, every clip the longest clip's frames; CFG on three (one with a negative prompt, one cut
# to its seconds), guidance 1 on three finishing together.
REQUESTS["stable-audio"] = [
    SamplingParams(prompt="a dog barking", seed=1, num_inference_steps=4),
    SamplingParams(prompt="a piano note", negative_prompt="noise", seed=2, num_inference_steps=3, guidance_scale=3.0),
    SamplingParams(
        prompt="rain", seed=3, num_inference_steps=3, arguments={"audio_start_in_s": 0.25, "audio_end_in_s": 0.75}
    ),
    *(SamplingParams(prompt=f"plain {i}", seed=10 + i, num_inference_steps=2, guidance_scale=1.0) for i in range(3)),
]
FIXTURES = {
    "stable-audio": "tiny_stable_audio",
    "sd3": "tiny_sd3",
    "sdxl": "tiny_sdxl",
    "flux": "tiny_flux",
    "flux-kontext": "tiny_kontext",
    "flux2-klein": "tiny_flux2klein",
    "flux2": "tiny_flux2",
    "z-image": "tiny_zimage",
    "ovis-image": "tiny_ovis",
    "longcat-image": "tiny_longcat",
    "longcat-image-edit": "tiny_longcat_edit",
    "glm-image": "tiny_glm_image",
    "qwen-image": "tiny_qwenimage",
    "qwen-image-21": "tiny_qwenimage21",
    "wan": "tiny_wan",
    "wan-i2v": "tiny_wan_i2v",
    "wan22": "tiny_wan22",
    "wan22-ti2v": "tiny_wan22_ti2v",
    "qwen-image-edit-plus": "tiny_qwenimage_edit_plus",
    "qwen-image-edit-2511": "tiny_qwenimage_edit_2511",
    "qwen-image-edit": "tiny_qwenimage_edit",
    "qwen-image-layered": "tiny_qwenimage_layered",
    "hunyuan-video-15": "tiny_hunyuan15",
}
# Edit-2511's layout (`zero_cond_t`: the input images' tokens modulated at timestep 0): Edit-Plus's requests.
REQUESTS["qwen-image-edit-2511"] = REQUESTS["qwen-image-edit-plus"]
# The first Qwen-Image-Edit: one image per request, no references.
# LongCat-Image-Edit: edits of one image each, read beside the prompt on rank 0 and shared; guidance 1 on two.
REQUESTS["longcat-image-edit"] = [
    edit(prompt="make it red", strength=None, negative_prompt="blurry", guidance_scale=3.0, num_inference_steps=3),
    edit(prompt="add a cat", image=picture(64, 64, seed=7), strength=None, seed=9, num_inference_steps=3),
    *(
        edit(
            prompt=f"plain edit {i}",
            image=picture(80, 64, seed=i),
            strength=None,
            seed=10 + i,
            num_inference_steps=2,
            guidance_scale=1.0,
        )
        for i in range(2)
    ),
]
REQUESTS["qwen-image-edit"] = [
    edit(prompt="make it red", strength=None, negative_prompt="blurry", true_cfg_scale=3.0, num_inference_steps=3),
    *(
        edit(prompt=f"plain edit {i}", image=picture(80, 64, seed=i), strength=None, seed=10 + i, num_inference_steps=2)
        for i in range(2)
    ),
]
# Qwen-Image-Layered: decompositions of one image each (two layers; one of a single layer batches alone).
REQUESTS["qwen-image-layered"] = [
    edit(
        prompt="layers",
        strength=None,
        negative_prompt="blurry",
        true_cfg_scale=3.0,
        num_inference_steps=3,
        arguments={"layers": 2},
    ),
    *(
        edit(
            prompt=f"plain layers {i}",
            image=picture(80, 64, seed=i),
            strength=None,
            seed=10 + i,
            num_inference_steps=2,
            arguments={"layers": 2},
        )
        for i in range(2)
    ),
    edit(prompt="one layer", strength=None, seed=3, num_inference_steps=2, arguments={"layers": 1}),
]
