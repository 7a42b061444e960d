"""A causal LM's chat setup, loaded once with the model: its chat template (from its Hugging Face files, or the
setting chat_template's file for it), the PromptEncoder that turns a conversation into its prompt ids, and the ids
that end a turn."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from model.checkpoint import HF_DIR, Checkpoint
from model.hf.chat_prompt import PromptEncoder
from model.hf.chat_template import ChatTemplateError, load_chat_template, template_files
from model.hf.common import HFImportError, read_config, read_json
from model.hf.generation import GENERATION_FILE, MAX_FILE_BYTES

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Chat:
    """A model's chat setup: ``encoder`` (its template, and the ids of the prompts it lays out) None where it cannot
    chat (``error``: why its template did not load; ``looked_at``: the files looked for), and the ids that end its
    turn (its generation config's EOS ids and the template's end-of-turn tokens)."""

    encoder: PromptEncoder | None
    stop_ids: tuple[int, ...] = ()
    error: str | None = None
    looked_at: tuple[str, ...] = ()

    @property
    def tool_call_format(self) -> str | None:
        """How its template writes tool calls ("hermes"), or None (another format, none, or no template)."""
        return self.encoder.template.tool_call_format if self.encoder is not None else None


def chat_template_for(spec: str, name: str) -> Path | None:
    """The chat template file the setting chat_template (``NAME=FILE`` entries, comma-separated) gives ``name``;
    ValueError naming a malformed entry."""
    chosen = {}
    for entry in (e.strip() for e in spec.split(",")):
        model, equals, file = entry.partition("=")
        if entry and (not equals or not model.strip() or not file.strip()):
            raise ValueError(f"{entry!r}: expected NAME=FILE (a model's name and its chat template file)")
        if entry:
            chosen[model.strip()] = Path(file.strip())
    return chosen.get(name)


def hf_directory(checkpoint: Checkpoint) -> Path | None:
    """Where a checkpoint's Hugging Face files are: its directory (an HF model), an imported checkpoint's ``hf/``,
    or None (a checkpoint of our own, trained here)."""
    directory = checkpoint.path
    if directory is None or checkpoint.format == "hf":
        return directory
    return directory / HF_DIR if (directory / HF_DIR).is_dir() else None


def eos_ids(directory: Path) -> list[int]:
    """The EOS ids of an HF directory's generation_config.json and config.json (one id, or a list: Llama 3's)."""
    ids = []
    for read in (lambda: read_json(directory / GENERATION_FILE, MAX_FILE_BYTES), lambda: read_config(directory)):
        try:
            eos = read().get("eos_token_id")
        except HFImportError:  # no such file: the model loaded without it
            continue
        ids += eos if isinstance(eos, list) else [eos]
    return ids


def load_chat(checkpoint: Checkpoint, override: Path | None) -> Chat:
    """The chat setup of a causal LM from its Hugging Face files (:func:`hf_directory`), or from ``override`` (a
    jinja file, which also gives a model of our own a template); a model of another family cannot chat."""
    if checkpoint.family != "causal_lm":
        return Chat(None)
    directory = hf_directory(checkpoint)
    try:
        template = load_chat_template(directory, override)
    except ChatTemplateError as exc:
        logger.warning("model at %s: chat template not loaded: %s", checkpoint.path, exc)
        return Chat(None, error=str(exc))
    if template is None:
        return Chat(None, looked_at=template_files(directory) if directory is not None else ())
    encoder = PromptEncoder(checkpoint.prompt_tokenizer, template)
    ids = [*(eos_ids(directory) if directory is not None else []), *encoder.end_of_turn_ids]
    vocab_size = checkpoint.prompt_tokenizer.vocab_size
    return Chat(encoder, tuple(dict.fromkeys(i for i in ids if type(i) is int and 0 <= i < vocab_size)))
