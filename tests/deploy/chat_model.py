"""A tiny random instruct model for the pages' and the README's chat tests: a LlamaForCausalLM saved by
transformers, a byte-level BPE with ChatML's special tokens (tests/hf_tokenizers.py) and SmolLM2-Instruct's ChatML
chat template in tokenizer_config.json (<|im_end|> ends a turn; the model's EOS is <|endoftext|>).

tests/service/test_chat.py builds its own (a Qwen2 with a Hermes tool-calling template) inside a fixture; this one is
a function, so that tests outside that module can build one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.chat_turns import CHATML  # SmolLM2-Instruct's template
from tests.hf_compare import randomize
from tests.hf_tokenizers import byte_level_bpe, write_directory

transformers = pytest.importorskip("transformers")


def chat_model_directory(directory: Path, seed: int = 11) -> Path:
    """A random Llama-style instruct model with a ChatML template, as transformers saves it, in ``directory``."""
    backend = byte_level_bpe()
    write_directory(directory, backend, {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML,
                                         "eos_token": "<|endoftext|>"}, "llama")
    eos = backend.token_to_id("<|endoftext|>")
    config = transformers.LlamaConfig(vocab_size=backend.get_vocab_size(), hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=1024, bos_token_id=eos, eos_token_id=eos,
                                      tie_word_embeddings=False)
    randomize(transformers.LlamaForCausalLM(config), seed=seed).save_pretrained(directory)
    return directory
