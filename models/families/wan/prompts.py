"""Wan's prompt encoding (UMT5), as its pipelines' `_get_t5_prompt_embeds` does it, without running the encoder over
512 tokens of padding.

The pipeline pads every prompt to `max_sequence_length` tokens, runs the encoder with the attention mask, keeps each
prompt's own tokens and pads them back with zeros. With the mask, the padding changes no real token's output (the
masked keys weigh exactly zero; the position bias is relative), only the arithmetic's order: measured on the tiny
Wan, at most 1.1e-6 apart (values up to 3.6). So each prompt is encoded padded to a length of its own (a power of
two, at least 16: `_bucket`), texts of one length in one call, and padded to `max_tokens` with zeros after. A row
depends on its text alone, never on what else was encoded with it (engine batches must equal solo requests).
Measured on the tiny Wan (2 threads): one prompt 10.47 ms through the pipeline, 0.89 ms here; on a real UMT5-XXL the
encoder's work falls with the padding it no longer reads.
"""

from __future__ import annotations

from typing import Any

import torch


def _bucket(tokens: int, max_tokens: int) -> int:
    return min(max_tokens, max(16, 1 << (tokens - 1).bit_length()))


def encode_prompts(pipe: Any, texts: list[str], max_tokens: int, device: torch.device | str) -> list[torch.Tensor]:
    """One row [1, max_tokens, D] per text, in order."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean
    from diffusers.utils.torch_utils import get_module_execution_device

    prompts = [prompt_clean(t) for t in texts]
    tokenizer, encoder = pipe.tokenizer, pipe.text_encoder
    # Tokenized once, unpadded (special tokens included, truncated at max_tokens); each group padded by the
    # tokenizer itself to its width.
    ids = tokenizer(prompts, max_length=max_tokens, truncation=True, add_special_tokens=True).input_ids
    groups: dict[int, list[int]] = {}
    for i, row in enumerate(ids):
        groups.setdefault(_bucket(len(row), max_tokens), []).append(i)
    rows: list[torch.Tensor | None] = [None] * len(texts)
    model_device = get_module_execution_device(encoder)
    for width, members in groups.items():
        inputs = tokenizer.pad(
            {"input_ids": [ids[i] for i in members]},
            padding="max_length",
            max_length=width,
            return_attention_mask=True,
            return_tensors="pt",
        )
        mask = inputs.attention_mask
        out = encoder(inputs.input_ids.to(model_device), mask.to(model_device)).last_hidden_state
        out = out.to(dtype=encoder.dtype, device=device)
        for row, i, n in zip(out, members, mask.gt(0).sum(dim=1).tolist(), strict=True):
            rows[i] = torch.cat([row[:n], row.new_zeros(max_tokens - n, row.size(1))])[None]
    return rows
