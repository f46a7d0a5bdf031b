"""The demo model's text side: its CLIP tokenizer (every word of the scene vocabulary one token), its two small
CLIP text encoders, how training encodes captions exactly as `StableDiffusion3Pipeline.encode_prompt` does (without
T5), and how v2 grew v1's encoders to a larger vocabulary without losing what they knew."""

from __future__ import annotations

from typing import Any

import torch

from diffusiond.tools.demo import scenes as sc

CLIP_MAX_LENGTH = 16
CLIP_HIDDEN = 64
CLIP_PROJECTION = 64


def make_tokenizer() -> Any:
    """A CLIPTokenizer in which every word of the scene grammar is one token; 16 tokens of context."""
    from diffusiond.models.tiny.text import make_clip_tokenizer

    return make_clip_tokenizer(sc.VOCABULARY, max_length=CLIP_MAX_LENGTH)


def make_text_encoder(tok: Any) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tok),
        hidden_size=CLIP_HIDDEN,
        intermediate_size=4 * CLIP_HIDDEN,
        num_hidden_layers=3,
        num_attention_heads=2,
        max_position_embeddings=CLIP_MAX_LENGTH,
        projection_dim=CLIP_PROJECTION,
        hidden_act="gelu",
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return CLIPTextModelWithProjection(config)


# A word new in v2's vocabulary starts from the embedding of the v1 word it stands in for, where there is one.
STAND_IN: dict[str, str] = {
    "little": "small",
    "tiny": "small",
    "big": "large",
    "ball": "circle",
    "dot": "circle",
    "disc": "circle",
    "box": "square",
    "centre": "center",
    "middle": "center",
    "upper": "top",
    "lower": "bottom",
    "with": "on",
    "against": "on",
}


@torch.no_grad()
def grow_text_encoder(old: Any, old_tok: Any, tok: Any) -> Any:
    """A text encoder for the tokenizer `tok` with `old`'s weights: every token `old_tok` has keeps its embedding
    (under its id in `tok`), a new word starts from its `STAND_IN`'s, any other new token from a fresh init."""
    grown = make_text_encoder(tok)
    key = "text_model.embeddings.token_embedding.weight"
    state = old.state_dict()
    old_rows = state[key]
    rows = grown.state_dict()[key].clone()
    old_vocab = old_tok.get_vocab()
    for token, i in tok.get_vocab().items():
        source = old_vocab.get(token)
        if source is None and token.endswith("</w>") and token[:-4] in STAND_IN:
            source = old_vocab[STAND_IN[token[:-4]] + "</w>"]
        if source is not None:
            rows[i] = old_rows[source]
    state[key] = rows
    grown.load_state_dict(state)
    return grown


def encode_text(te1: Any, te2: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As `StableDiffusion3Pipeline.encode_prompt` without T5 and before the zero tokens: (penultimate hidden states
    of both encoders concatenated [B, 16, 128], projected pooled outputs concatenated [B, 128])."""
    out1 = te1(ids, output_hidden_states=True)
    out2 = te2(ids, output_hidden_states=True)
    embeds = torch.cat([out1.hidden_states[-2], out2.hidden_states[-2]], dim=-1)
    pooled = torch.cat([out1[0], out2[0]], dim=-1)
    return embeds, pooled


def with_zero_token(embeds: torch.Tensor) -> torch.Tensor:
    return torch.cat([embeds, embeds.new_zeros(embeds.shape[0], 1, embeds.shape[2])], dim=1)


def tokenize(tok: Any, captions: list[str]) -> torch.Tensor:
    """Exactly as the pipeline tokenizes for CLIP."""
    return tok(
        captions, padding="max_length", max_length=CLIP_MAX_LENGTH, truncation=True, return_tensors="pt"
    ).input_ids


class FastTokenizer:
    """The demo tokenizer's ids for captions of `scenes.describe` (every word and punctuation mark one token, at
    most 14), 100x faster than calling the CLIPTokenizer (which took 0.15 s for a batch of 64, a third of a
    training step); checked against it on construction."""

    def __init__(self, tok: Any, check: list[str]) -> None:
        self.vocab = tok.get_vocab()
        self.bos, self.eos = tok.bos_token_id, tok.eos_token_id
        got, expected = self(check), tokenize(tok, check)
        if not torch.equal(got, expected):
            raise RuntimeError("FastTokenizer differs from the CLIP tokenizer")

    def __call__(self, captions: list[str]) -> torch.Tensor:
        ids = torch.full((len(captions), CLIP_MAX_LENGTH), self.eos, dtype=torch.long)
        for row, caption in enumerate(captions):
            words = [self.vocab[w + "</w>"] for w in sc.tokens(caption)]
            if len(words) > CLIP_MAX_LENGTH - 2:
                raise ValueError(f"caption too long for the demo tokenizer: {caption!r}")
            ids[row, : len(words) + 1] = torch.tensor([self.bos, *words])
        return ids
