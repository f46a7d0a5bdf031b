"""The tiny checkpoints' text side, built offline: CLIP and T5 tokenizers over a fixed list of a few hundred common
English words (every listed word is one token; any other text still tokenizes through single-character fallback
tokens: CLIP's 256 byte-level symbols, with and without the `</w>` end-of-word suffix; T5's "▁" plus printable ASCII
characters), and the tiny CLIP and T5 text encoders' configs. Every family's builder (models/tiny/) reads them.
"""

from __future__ import annotations

from typing import Any

# Common English words, plus colours, shapes, animals and photo vocabulary; each becomes a single token in both the
# CLIP and the T5 tokenizer. Lower case ASCII letters only (CLIP lower-cases its input).
_WORD_TEXT = """
    a an the of on in at to by for with from and or but not no is are was be it its this that these those there
    here what which who how very more most some many much few all each every one two three four five six seven
    eight nine ten photo photograph picture image painting drawing sketch illustration render portrait landscape
    close up view top side front back left right center middle above below under over near far behind between
    inside outside background foreground scene style art artwork detailed realistic abstract simple beautiful cute
    small big large tiny huge tall short long wide thin thick old new young bright dark light soft hard shiny
    smooth rough round flat sharp high low quality best masterpiece cinematic lighting sunset sunrise night day
    morning evening sky sun moon star stars cloud clouds rain snow fog storm wind water sea ocean lake river beach
    sand mountain mountains hill forest tree trees flower flowers grass leaf leaves rock stone field garden park
    city street road house building tower bridge castle church room window door wall floor table chair bed car bus
    train boat ship plane bicycle cat cats dog dogs bird birds fish horse cow sheep pig rabbit mouse lion tiger
    bear fox wolf deer monkey elephant giraffe zebra duck owl frog snake butterfly man woman boy girl child people
    person face eyes hair hand hands smile smiling wearing hat shirt dress coat shoes glasses sitting standing
    walking running flying swimming playing holding looking red orange yellow green blue purple pink brown black
    white gray grey gold golden silver colorful colourful color colour circle square triangle rectangle shape
    shapes line lines dot dots stripe stripes pattern grid cube sphere ball box cup bowl plate bottle book lamp
    clock apple banana cake bread pizza coffee tea fire smoke glass metal wood wooden paper plastic robot computer
    phone camera toy flag sign text letter word space planet earth galaxy neon lights reflection shadow shadows
    texture oil watercolor pencil cartoon anime digital vintage retro modern futuristic fantasy magic dream happy
    sad calm quiet empty full alone together
"""
WORDS: tuple[str, ...] = tuple(dict.fromkeys(_WORD_TEXT.split()))

CLIP_MAX_LENGTH = 77
T5_MAX_LENGTH = 512

_BOS = "<|startoftext|>"
_EOS = "<|endoftext|>"
_EOW = "</w>"


# --------------------------------------------------------------------------------------------------- tokenizers


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte-level mapping: each of the 256 bytes to a printable unicode character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def _bpe(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Greedy BPE as the `tokenizers` library applies it: repeatedly merge the lowest-ranked adjacent pair,
    leftmost first."""
    symbols = list(symbols)
    while len(symbols) > 1:
        best: tuple[int, int] | None = None
        for i in range(len(symbols) - 1):
            r = ranks.get((symbols[i], symbols[i + 1]))
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    return symbols


def add_merges(
    symbols: list[str], vocab: dict[str, int], merges: list[tuple[str, str]], ranks: dict[tuple[str, str], int]
) -> None:
    """Make `symbols` one token: split with the merges so far, then join the remaining pieces left to right by new,
    lower-priority merges (added to `merges`, `ranks` and `vocab`)."""
    pieces = _bpe(symbols, ranks)
    while len(pieces) > 1:
        pair = (pieces[0], pieces[1])
        if pair not in ranks:
            ranks[pair] = len(merges)
            merges.append(pair)
        merged = pair[0] + pair[1]
        vocab.setdefault(merged, len(vocab))
        pieces = [merged, *pieces[2:]]


def clip_vocab_and_merges(words: tuple[str, ...] = WORDS) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A CLIP BPE vocabulary in which every word of `words` is a single `word</w>` token.

    Layout follows the real CLIP vocabulary: the 256 byte symbols, the same with `</w>`, then merge results, then
    `<|startoftext|>` and `<|endoftext|>` last. Merges are added word by word: the word is first split with the
    merges so far, and the remaining pieces are joined left to right by new, lower-priority merges. Since earlier
    words always have a higher-priority merge available until they are whole, new merges never change how an
    earlier word splits (a merge list made per word in isolation does: "or" from "orange" would break "forest").
    """
    byte_symbols = list(bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for s in byte_symbols:
        vocab[s] = len(vocab)
    for s in byte_symbols:
        vocab[s + _EOW] = len(vocab)
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    for word in dict.fromkeys(words):
        add_merges([*word[:-1], word[-1] + _EOW], vocab, merges, ranks)
    vocab[_BOS] = len(vocab)
    vocab[_EOS] = len(vocab)
    return vocab, merges


def make_clip_tokenizer(words: tuple[str, ...] = WORDS, max_length: int = CLIP_MAX_LENGTH) -> Any:
    """A CLIPTokenizer with one token per listed word (raises if it splits one), `max_length` tokens of context.

    Built from in-memory `vocab=dict, merges=list[tuple]`: under transformers v5, `CLIPTokenizer(vocab_file=...,
    merges_file=...)` silently yields a tokenizer that maps text to garbage ids.
    """
    from transformers import CLIPTokenizer

    vocab, merges = clip_vocab_and_merges(words)
    tok = CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=_EOS,
        bos_token=_BOS,
        eos_token=_EOS,
        pad_token=_EOS,
        model_max_length=max_length,
    )
    _check_single_tokens(tok, words, lambda w: [vocab[w + _EOW]], bos=[tok.bos_token_id], eos=[tok.eos_token_id])
    return tok


def t5_vocab(words: tuple[str, ...] = WORDS) -> list[tuple[str, float]]:
    """A Unigram vocabulary: `<pad>`=0, `</s>`=1, `<unk>`=2, then "▁word" pieces (preferred: one piece scores
    far better than spelling a word out), then "▁" and printable ASCII characters as the fallback."""
    vocab: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [("▁" + w, -5.0 - i * 1e-3) for i, w in enumerate(dict.fromkeys(words))]
    vocab.append(("▁", -8.0))
    vocab += [(chr(c), -10.0) for c in range(ord("!"), ord("~") + 1)]
    return vocab


def make_t5_tokenizer(words: tuple[str, ...] = WORDS) -> Any:
    """A T5 tokenizer (`T5TokenizerFast`, an alias of `T5Tokenizer` in transformers v5) with one piece per word."""
    from transformers import T5TokenizerFast

    vocab = t5_vocab(words)
    tok = T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=T5_MAX_LENGTH)
    ids = {piece: i for i, (piece, _) in enumerate(vocab)}
    _check_single_tokens(tok, words, lambda w: [ids["▁" + w]], bos=[], eos=[tok.eos_token_id])
    return tok


def _check_single_tokens(tok: Any, words: tuple[str, ...], expect: Any, *, bos: list[int], eos: list[int]) -> None:
    got = tok(list(words))["input_ids"]
    bad = [w for w, ids in zip(words, got, strict=True) if ids != bos + expect(w) + eos]
    if bad:
        raise RuntimeError(f"tiny tokenizer {type(tok).__name__} splits listed words: {bad[:10]}")


def clip_config(tok: Any, *, projection_dim: int | None = None) -> Any:
    from transformers import CLIPTextConfig

    # vocab_size and the special ids must match the tokenizer: CLIP pools the hidden state at the first
    # eos_token_id position (legacy argmax pooling only when eos_token_id == 2).
    kwargs: dict[str, Any] = {}
    if projection_dim is not None:
        kwargs["projection_dim"] = projection_dim
    return CLIPTextConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=CLIP_MAX_LENGTH,
        hidden_act="gelu",
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **kwargs,
    )


def t5_encoder(tok: Any, d_model: int) -> Any:
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=len(tok),
        d_model=d_model,
        d_kv=16,
        d_ff=37,
        num_layers=2,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        decoder_start_token_id=tok.pad_token_id,
    )
    return T5EncoderModel(config)
