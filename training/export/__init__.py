"""Export checkpoints as Hugging Face `transformers` model directories that load without custom code.

seq2seq -> MarianMTModel (marian.py), causal_lm -> GPT2LMHeadModel (gpt2.py), classifier ->
BertForSequenceClassification (bert.py), when the config can be expressed exactly; any other config
is refused with the field that does not fit. Only torch, safetensors and tokenizers are used: the
config.json and model.safetensors are written here in HF's naming, so `transformers` need not be
installed to export.
"""

from training.export.common import ExportError
from training.export.hf import check_exportable, export_hf

__all__ = ["ExportError", "check_exportable", "export_hf"]
