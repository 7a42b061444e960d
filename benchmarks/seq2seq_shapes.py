"""The NLLB-200 and Flan-T5 shapes of benchmarks/shapes.py: their configs and tokenizers (issue 39).

``nllb-200-distilled-600m``: M2M100ForConditionalGeneration with facebook/nllb-200-distilled-600M's config (pre-LN,
ReLU, scaled embeddings, sinusoidal positions, tied head, EOS 2 as the decoder start) and an NllbTokenizer of its
layout: ``<s> <pad> </s> <unk>``, filler pieces up to id 256,000, the 202 language codes (the tokenizer's own list),
``<mask>``; the model's 256,206 rows leave two ids no token names (CTranslate2's converter names them
``madeupword``). The target language is the forced first token (generate()'s ``forced_bos_token_id``).
``flan-t5-base``: T5ForConditionalGeneration with google/flan-t5-base's config (gated GELU, RMSNorm, relative
position buckets, untied head, pad 0 as the decoder start) and a T5Tokenizer whose pieces and 100 sentinels fill
all 32,128 rows (the released one names 32,100 and leaves 28 rows unnamed; CTranslate2's converter would then name
them ``<extra_id_0..27>`` a second time, which makes its token strings ambiguous): the same compute, unique strings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

NLLB_TARGET = "fra_Latn"  # the forced first token of every engine's translations
NLLB_BASE_VOCAB = 256_001  # ids before the language codes in NLLB-200's tokenizer (fairseq's 4 specials + pieces)
T5_SENTINELS = 100


def nllb(vocab: int, d: int, layers: int, heads: int, ffn: int) -> dict[str, Any]:
    """facebook/nllb-200-distilled-600M's config.json fields (the sizes given)."""
    return dict(vocab_size=vocab, d_model=d, encoder_layers=layers, decoder_layers=layers,
                encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn,
                decoder_ffn_dim=ffn, activation_function="relu", scale_embedding=True, max_position_embeddings=1024,
                pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, tie_word_embeddings=True,
                init_std=0.02, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0,
                decoder_layerdrop=0.0)


def t5(vocab: int, d: int, layers: int, heads: int, d_kv: int, d_ff: int) -> dict[str, Any]:
    """google/flan-t5-base's config.json fields (T5 v1.1: gated GELU, untied head; the sizes given)."""
    return dict(vocab_size=vocab, d_model=d, d_kv=d_kv, d_ff=d_ff, num_layers=layers, num_decoder_layers=layers,
                num_heads=heads, relative_attention_num_buckets=32, relative_attention_max_distance=128,
                feed_forward_proj="gated-gelu", tie_word_embeddings=False, layer_norm_epsilon=1e-6,
                dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)


def languages(vocab: int) -> list[str]:
    """The language codes of a shape's tokenizer: NLLB's 202 (a tiny shape: the first four and the target)."""
    from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES

    return list(FAIRSEQ_LANGUAGE_CODES) if vocab > NLLB_BASE_VOCAB else \
        list(dict.fromkeys([*FAIRSEQ_LANGUAGE_CODES[:4], NLLB_TARGET]))


def write_tokenizer(architecture: str, vocab: int, directory: Path) -> None:
    """The shape's tokenizer (tokenizer.json and tokenizer_config.json, as transformers' save_pretrained writes)."""
    if architecture.startswith("M2M100"):
        _nllb_tokenizer(vocab).save_pretrained(directory)
    else:
        _t5_tokenizer(vocab).save_pretrained(directory)


def _nllb_tokenizer(vocab: int):
    """NllbTokenizer over filler pieces: ``<s> <pad> </s> <unk>``, pieces, the language codes, ``<mask>``; two
    model rows past it unnamed (a tiny shape: fewer pieces, the same two)."""
    import transformers

    codes = languages(vocab)
    base = min(NLLB_BASE_VOCAB, vocab - len(codes) - 3)  # codes, <mask> and the two unnamed rows follow
    pieces = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3} | {f"\u2581w{i}": i for i in range(4, base)}
    return transformers.NllbTokenizer(vocab=pieces, merges=[], additional_special_tokens=codes,
                                      src_lang=codes[0], tgt_lang=NLLB_TARGET)


def _t5_tokenizer(vocab: int):
    """T5Tokenizer (a Unigram) whose pieces and 100 sentinels name every one of the model's ``vocab`` rows."""
    import transformers

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(f"\u2581w{i}", -3.0 - i / vocab) for i in range(vocab - T5_SENTINELS - len(pieces))]
    pieces += [(f"<extra_id_{i}>", 0.0) for i in range(T5_SENTINELS - 1, -1, -1)]
    return transformers.T5Tokenizer(vocab=pieces, extra_ids=T5_SENTINELS)


def own_head(model) -> None:
    """An untied head (Flan-T5's) weights of its own, drawn as T5's initialisation does (normal, std 1): transformers
    ties it to the embeddings at construction and keeps it apart on loading only when the saved tensors differ."""
    import torch

    untied = getattr(model.config, "scale_decoder_outputs", True) is False  # config.json's tie_word_embeddings false
    if untied and model.lm_head.weight is model.get_input_embeddings().weight:
        generator = torch.Generator().manual_seed(1)
        weight = torch.empty_like(model.lm_head.weight).normal_(0.0, 1.0, generator=generator)
        model.lm_head.weight = torch.nn.Parameter(weight)


def special_ids(architecture: str, vocab: int) -> tuple[int, int]:
    """[low, high): the ids of ordinary pieces (random inputs draw from them: no special, code or sentinel)."""
    if architecture.startswith("M2M100"):
        return 4, vocab - len(languages(vocab)) - 3
    return 4, vocab - T5_SENTINELS


__all__ = ["NLLB_TARGET", "languages", "nllb", "own_head", "special_ids", "t5", "write_tokenizer"]
