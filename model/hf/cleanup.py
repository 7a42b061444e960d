"""transformers' ``clean_up_tokenization_spaces``: decoded text loses the space before punctuation and English
contractions (" ," -> ","), where tokenizer_config.json asks for it. Its tokenizers-backed classes skip it over a BPE
model (NllbTokenizer's) unless ``clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output`` is set;
its Python classes (M2M100Tokenizer) apply it whatever the model."""

from __future__ import annotations

from typing import Any

# in transformers' order (clean_up_tokenization): each replacement sees the text the ones before it left
REPLACEMENTS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))
FORCE_BPE = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"


def clean_up_tokenization(text: str) -> str:
    """``text`` without the spaces transformers' clean_up_tokenization removes."""
    for before, after in REPLACEMENTS:
        text = text.replace(before, after)
    return text


def cleans_up(settings: dict[str, Any], bpe: bool) -> bool:
    """Whether transformers cleans up decoded text for tokenizer_config.json ``settings`` (``bpe``: a tokenizers-backed
    class over a BPE model)."""
    return bool(settings.get("clean_up_tokenization_spaces")) and (not bpe or bool(settings.get(FORCE_BPE)))
