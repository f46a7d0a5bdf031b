"""Wan's prompts through UMT5 without 512 tokens of padding (models/families/wan/prompts.py): the rows equal the
pipeline's `encode_prompt` (tolerance 1e-5; measured 1.1e-6 on values up to 3.6), a row does not depend on what else was
encoded with it (exactly), and the encoder really reads less. Broken on purpose once (every bucket 512): the last
test went red."""

from __future__ import annotations

import torch

from diffusiond.models.families.wan import prompts as wan_prompts
from diffusiond.models.families.wan.attention import TEXT_TOKENS
from diffusiond.models.loading.loader import load_adapter

PROMPTS = ["a red cat", "a dog running across a green field under a cloudy sky, wide shot", "long " * 600, ""]


def test_rows_equal_the_pipelines_and_depend_on_their_text_alone(tiny_wan):
    adapter = load_adapter(tiny_wan)
    pipe = adapter.pipe
    widths: list[int] = []
    hook = pipe.text_encoder.register_forward_pre_hook(lambda _m, args: widths.append(args[0].shape[1]))
    try:
        with torch.inference_mode():
            reference, _ = pipe.encode_prompt(
                prompt=PROMPTS, do_classifier_free_guidance=False, max_sequence_length=TEXT_TOKENS, device="cpu"
            )
            widths.clear()
            rows = wan_prompts.encode_prompts(pipe, PROMPTS, TEXT_TOKENS, "cpu")
            alone = [wan_prompts.encode_prompts(pipe, [p], TEXT_TOKENS, "cpu")[0] for p in PROMPTS]
    finally:
        hook.remove()
    assert all(r.shape == (1, TEXT_TOKENS, reference.shape[2]) for r in rows)
    assert torch.allclose(torch.cat(rows), reference, rtol=0, atol=1e-5), (torch.cat(rows) - reference).abs().max()
    assert all(torch.equal(r, a) for r, a in zip(rows, alone, strict=True))
    # The short prompts ran padded to 16 and 32 tokens, the one over 512 truncated to 512, "" at 16.
    assert sorted(widths[:3]) == [16, 32, TEXT_TOKENS], widths
