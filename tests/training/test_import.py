"""`python -m training import --from hf`: a Hugging Face directory as our checkpoint, and back with export.

The directories are the ones tests/hf_directories.py builds with `transformers` (the service tests serve them):
a GPT-2, a BERT classifier and an OPUS-MT translator with their tokenizer files. The imported checkpoint
must compute what the directory computes and encode as it does; exporting it gives back the same tensors
and a tokenizer that gives the same ids.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model.checkpoint import HF_DIR, load_checkpoint
from tests.hf_directories import PAIRS, TEXTS, bert_directory, gpt2_directory, opus_mt_directory
from tests.service.fixtures import run_training
from training.errors import UserError

transformers = pytest.importorskip("transformers")

BUILDERS = {
    "gpt2": gpt2_directory,
    "bert": lambda d: bert_directory(d, head=True),
    "opus-mt": opus_mt_directory,
    # transformers then keeps a model.shared.weight its forward never reads (exported as the encoder's)
    "opus-mt-untied": lambda d: opus_mt_directory(d, tie_word_embeddings=False),
    "opus-mt-separate-vocabularies": lambda d: opus_mt_directory(d, share_encoder_decoder_embeddings=False),
}


@pytest.fixture(scope="module", params=list(BUILDERS))
def imported(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """(name, HF directory, our imported checkpoint)."""
    root = tmp_path_factory.mktemp(request.param)
    source = BUILDERS[request.param](root / "hf")
    run_training("import", "--from", "hf", str(source), "--out", str(root / "ckpt"))
    return request.param, source, root / "ckpt"


def test_an_imported_checkpoint_computes_and_encodes_as_its_directory(imported):
    name, source, ckpt = imported
    theirs, ours = load_checkpoint(source, device="cpu"), load_checkpoint(ckpt, device="cpu")
    assert (theirs.format, ours.format) == ("hf", "tserve") and (ckpt / HF_DIR).is_dir()
    assert not (ckpt / "tokenizer.json").exists()  # the HF tokenizer is the one under hf/
    if name == "bert":
        assert ours.labels == theirs.labels and ours.tokenizer.encode_pair(*PAIRS[0]) == theirs.tokenizer.encode_pair(
            *PAIRS[0])
        ids, segments = (torch.tensor([x]) for x in ours.tokenizer.encode_pair(*PAIRS[0]))
        assert torch.equal(ours.model(ids, segments), theirs.model(ids, segments))
        return
    prompts = ours.encode_prompts(TEXTS)
    assert prompts == theirs.encode_prompts(TEXTS) and ours.generation == theirs.generation
    ids = torch.tensor([prompts[0]])
    if name == "gpt2":
        assert torch.equal(ours.model(ids), theirs.model(ids))
    else:
        start = torch.tensor([[ours.config.bos_id]])
        assert torch.equal(ours.model(ids, start), theirs.model(ids, start))


def test_export_of_an_imported_checkpoint_gives_back_the_directory(imported, tmp_path):
    name, source, ckpt = imported
    run_training("export", "--model", str(ckpt), "--to", "hf", "--out", str(tmp_path / "out"))
    original, exported = (load_file(str(d / "model.safetensors")) for d in (source, tmp_path / "out"))
    assert original.keys() == exported.keys()
    dead = {"model.shared.weight"} if name == "opus-mt-untied" else set()
    assert all(torch.equal(original[k], exported[k]) for k in original.keys() - dead)
    if name.startswith("opus-mt"):  # OPUS-MT's SentencePiece tokenizer (no tokenizer.json)
        tokenizers = [transformers.MarianTokenizer(*(str(d / f) for f in ("source.spm", "target.spm", "vocab.json")))
                      for d in (source, tmp_path / "out")]
    else:
        tokenizers = [transformers.AutoTokenizer.from_pretrained(d) for d in (source, tmp_path / "out")]
    assert [tokenizers[0](t)["input_ids"] for t in TEXTS] == [tokenizers[1](t)["input_ids"] for t in TEXTS]


def test_import_refuses_what_it_cannot_read_and_an_existing_output(tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "falcon"}')
    with pytest.raises(UserError, match="model_type='falcon' is not supported"):
        run_training("import", "--from", "hf", str(tmp_path / "broken"), "--out", str(tmp_path / "out"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    with pytest.raises(UserError, match="already exists"):
        run_training("import", "--from", "hf", str(tmp_path / "broken"), "--out", str(tmp_path / "out"))
