"""ModernBERT directories as our classifier (model/hf/modernbert.py), saved by `transformers` itself with random weights
(tests/model/hf_modernbert.py): 4 layers, local ones with a window of |i - j| <= 2 on rows longer than it.

The headless model's hidden states, every sequence head (cls and mean pooling, single-label, multi-label, one label)
and the token head equal transformers' (SDPA) on padded batches within 1e-4 in float32 and 1e-9 in float64; the
blocks the C++ encoder does not implement send the model to the layers (model.native_support.unsupported). Our own
ModernBERT-shaped checkpoint round-trips; what the classifier config cannot run, and what the importer cannot
express, is refused by name. The tokenizer.json encodes as transformers' ([CLS] a [SEP] (b [SEP])). PEFT adapters on
``Wqkv Wo Wi`` (fused: split onto our q/k/v and fc1/up) and the head give PeftModel's logits alone and mixed, and
ours saved back load in PEFT with the same logits; on the token head too (TOKEN_CLS: its own ``classifier``), each
real token's logits in float32 and float64 (copies of ``head`` with its norm: test_hf_modernbert_head_copies.py).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch

from model.checkpoint import HF_DIR, load_checkpoint, load_hf_checkpoint, save_checkpoint
from model.classifier import TransformerClassifier, label_scores
from model.config import ClassifierConfig, ModelConfigError, Seq2SeqConfig
from model.hf import HFImportError, companion_files, load_hf_model
from model.lora import layers_with, use_adapters
from model.lora_io import load_adapter, save_adapter
from model.lora_layers import HeadCopies
from model.native_support import unsupported
from tests.hf_compare import ATOL, peft_adapter
from tests.hf_directories import PAIRS, TEXTS
from tests.model.hf_modernbert import HEADS, modernbert_directory, save

transformers = pytest.importorskip("transformers")

ROWS = [[10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37]]
PAD = 0
# head -> what classify serves of the logits (transformers' text-classification pipeline's rule; None: no sequence)
SERVES = {"model": None, "cls": lambda x: torch.softmax(x, -1), "mean": torch.sigmoid, "one-label": torch.sigmoid,
          "token": None}


def batch() -> torch.Tensor:
    """[CLS] row [SEP], right-padded: rows longer and shorter than the local window."""
    width = max(map(len, ROWS)) + 4
    return torch.tensor([[1, *r, 2] + [PAD] * (width - len(r) - 2) for r in ROWS])


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("modernbert")
    return {head: (root / head, save(root / head, head, seed=i)) for i, head in enumerate(HEADS)}


@pytest.mark.parametrize("head", HEADS)
def test_modernbert_equals_transformers_on_padded_batches(saved, head):
    directory, theirs = saved[head]
    ids = batch()
    real = ids != PAD
    for dtype, tolerance in ((torch.float32, ATOL), (torch.float64, 1e-9)):
        ours, config = load_hf_model(directory, dtype)
        with torch.no_grad():
            expected = theirs.to(dtype)(input_ids=ids, attention_mask=real.long())
        with torch.inference_mode():  # the encoder's fast path where it would run
            if head == "model":
                got, want = ours.encode(ids)[0][real], expected.last_hidden_state[real]
            elif head == "token":
                got, want = ours.token_logits(ids)[real], expected.logits[real]
            else:
                logits = ours(ids)
                got, want = label_scores(logits, config.output_activation), SERVES[head](expected.logits)
                assert (logits - expected.logits).abs().max() < tolerance, (dtype, "logits")
        assert (got - want).abs().max() < tolerance, (dtype, float((got - want).abs().max()))
    theirs.float()
    assert config.window_layers == [t == "sliding_attention" for t in theirs.config.layer_types]
    assert (config.sliding_window, config.bidirectional_window) == (3, True)  # local_attention 4: |i - j| <= 2
    assert config.head_pooling == ("cls" if head == "token" else theirs.config.classifier_pooling)


def test_the_blocks_the_cpp_encoder_lacks_send_modernbert_to_the_layers(saved):
    """bidirectional windows, layer 0 without its attention norm and rotation through float32 are not in the C++
    encoder: the stack says so, and run_encoder's chunks of rows (a batch larger than one chunk) take the layers."""
    model, config = load_hf_model(saved["cls"][0])
    assert {"bidirectional_window", "first_attn_norm", "rotary_float32"} <= set(unsupported(config))
    assert not model.encoder.native
    ids = batch().repeat(200, 1)  # over model.fast_step.ENCODER_CHUNK_TOKENS: encoded in chunks of rows
    with torch.inference_mode():
        chunked = model(ids)
    with torch.no_grad():
        whole = model(ids[:3])
    assert (chunked[:3] - whole).abs().max() < 1e-5 and (chunked.view(200, 3, -1) - whole).abs().max() < 1e-5


def test_our_modernbert_shaped_checkpoint_round_trips(saved, tmp_path):
    """Saved as an imported checkpoint is (our weights and config, the HF files under hf/), loaded back."""
    directory = modernbert_directory(tmp_path / "hf", "mean")
    checkpoint = load_hf_checkpoint(directory, device="cpu")
    save_checkpoint(tmp_path / "ours", checkpoint.model, None,
                    extra_files={f"{HF_DIR}/{name}": data for name, data in companion_files(directory).items()})
    loaded = load_checkpoint(tmp_path / "ours", device="cpu")
    assert loaded.config == checkpoint.config and loaded.config.head_pooling == "mean"
    ids = batch()
    with torch.no_grad():
        assert torch.equal(loaded.model(ids), checkpoint.model(ids))


MODERN = dict(positions="rope", ffn="gated", norm="pre", sliding_window=3, bidirectional_window=True,
              window_layers=[False, True, True, False], first_attn_norm=False, rotary_float32=True, num_labels=2,
              head_norm=True, pooler_activation="gelu", type_vocab_size=0, d_model=32, n_heads=4, d_ff=24)


@pytest.mark.parametrize(("change", "says"), [
    (dict(bidirectional_window=False), "sliding_window of an encoder needs bidirectional_window"),
    (dict(window_layers=[True]), r"window_layers must have one entry per layer \(4\)"),
    (dict(position_offset=2), "position_offset needs positions='learned'"),
    (dict(pooler=False), "head_norm needs a pooler"),
    (dict(head="token", head_pooling="mean"), "head_pooling 'mean' needs head='sequence'"),
    (dict(head_pooling="max"), "head_pooling must be one of"),
    (dict(pooler_activation="swish"), "pooler_activation must be one of"),
    (dict(norm="post"), "first_attn_norm False needs norm='pre'"),
    (dict(sliding_window=None, window_layers=None), "bidirectional_window needs a sliding_window"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_classifier_configs_it_cannot_run_are_refused_by_field(change, says):
    with pytest.raises(ModelConfigError, match=says):
        ClassifierConfig(**{**MODERN, **change})


def test_the_new_fields_keep_other_families_unchanged():
    """Defaults keep every existing model as it was (and on the C++ path); layer 0 of ours loses its norm alone."""
    assert not ClassifierConfig().extended and ClassifierConfig().head_pooling == "cls"
    assert unsupported(ClassifierConfig()) == [] and unsupported(Seq2SeqConfig()) == []
    model = TransformerClassifier(ClassifierConfig(**MODERN))
    assert isinstance(model.encoder.layers[0].self_attn_norm, torch.nn.Identity)
    assert isinstance(model.encoder.layers[1].self_attn_norm, torch.nn.LayerNorm)


@pytest.mark.parametrize(("change", "says"), [
    (dict(architectures=["ModernBertForMaskedLM"]), "architectures=.*not supported for modernbert"),
    (dict(classifier_pooling="max"), "classifier_pooling='max' is not supported"),
    (dict(hidden_activation="gelu_fast"), "hidden_activation='gelu_fast' is not supported"),
    (dict(classifier_activation="tanh"), "classifier_activation='tanh' is not supported"),
    (dict(head_dim=16), "head_dim=16 is not supported for ModernBERT"),
    (dict(layer_types=["full_attention"]), "layer_types must list one of"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 160.0},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10.0}}},
     "rope scaling or a partial rotary width on the sliding_attention layers is not supported"),
], ids=["masked-lm", "pooling", "activation", "classifier-activation", "head-dim", "layer-types", "local-scaling"])
def test_what_the_importer_cannot_express_is_refused_by_name(saved, tmp_path, change, says):
    hf = json.loads((saved["cls"][0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, **change}))
    with pytest.raises(HFImportError, match=says):
        load_hf_model(tmp_path)


def test_older_config_files_read_global_attn_every_n_layers_and_the_rope_thetas(saved, tmp_path):
    """Files from before layer_types and rope_parameters: every n-th layer global, global/local_rope_theta."""
    directory, theirs = saved["cls"]
    hf = json.loads((directory / "config.json").read_text())
    for key in ("layer_types", "rope_parameters"):
        hf.pop(key)
    (tmp_path / "config.json").write_text(json.dumps({**hf, "global_rope_theta": 160.0, "local_rope_theta": 10.0}))
    (tmp_path / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes())
    config = load_hf_model(tmp_path)[1]
    assert config == load_hf_model(directory)[1]


def test_the_tokenizer_encodes_as_transformers(tmp_path):
    directory = modernbert_directory(tmp_path / "hf", "cls")
    ours = load_hf_checkpoint(directory, device="cpu").tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    for text in TEXTS:
        assert ours.encode_pair(text)[0] == theirs(text)["input_ids"], text
    for a, b in PAIRS:
        assert ours.encode_pair(a, b)[0] == theirs(a, b)["input_ids"], (a, b)


# -- PEFT adapters -------------------------------------------------------------------------------------------------

TEXTS4 = [*TEXTS, "the lazy dog jumps over the quick brown fox again and again"]


def hf_logits(directory: Path, adapter: Path | None) -> torch.Tensor:
    """transformers' (with PeftModel's ``adapter``) logits on TEXTS4, padded."""
    peft = pytest.importorskip("peft")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(directory).eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    batch_ = transformers.AutoTokenizer.from_pretrained(directory)(TEXTS4, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(input_ids=batch_["input_ids"], attention_mask=batch_["attention_mask"]).logits


@pytest.fixture(scope="module")
def peft_directory(tmp_path_factory) -> Path:
    pytest.importorskip("peft")
    return modernbert_directory(tmp_path_factory.mktemp("modernbert-peft"), "cls")


def adapters(directory: Path, root: Path, auto: str = "AutoModelForSequenceClassification", **fields
             ) -> dict[str, Path]:
    """Adapter "a" on Wqkv, Wo, Wi and the head's dense; "b" on Wqkv of layer 1 and Wi by a regex (of ``auto``'s
    model)."""
    targets = (["Wqkv", "Wo", "Wi", "dense"], r".*layers\.1\.attn\.Wqkv|.*mlp\.Wi")
    base = getattr(transformers, auto).from_pretrained
    return {name: peft_adapter(base(directory), root / name, seed=i, r=2 + i, lora_alpha=4, target_modules=t,
                               **fields)
            for i, (name, t) in enumerate(zip("ab", targets, strict=True))}


@pytest.mark.parametrize("task_type", [None, "SEQ_CLS"])
def test_lora_adapters_give_peft_logits_alone_and_mixed_and_save_back(peft_directory, tmp_path, task_type):
    """Fused Wqkv / Wi LoRAs split onto our q/k/v and fc1/up (a shared A, B's rows split); SEQ_CLS adapters carry
    their own classifier (modules_to_save); ours saved back as one LoRA per fused module load in PEFT."""
    paths = adapters(peft_directory, tmp_path, **({"task_type": task_type} if task_type else {}))
    checkpoint = load_hf_checkpoint(peft_directory, device="cpu")
    for name, path in paths.items():
        load_adapter(checkpoint.model, path, name, layout=checkpoint.adapter_layout)
    model = checkpoint.model
    assert isinstance(model.classifier, HeadCopies) == (task_type == "SEQ_CLS")
    ids = transformers.AutoTokenizer.from_pretrained(peft_directory)(TEXTS4, padding=True,
                                                                      return_tensors="pt")["input_ids"]
    expected = {name: hf_logits(peft_directory, paths.get(name)) for name in ("a", "b", None)}
    assert all((expected[n] - expected[None]).abs().max() > 1e-2 for n in "ab")
    with torch.no_grad():
        for name, want in expected.items():
            with use_adapters(model, name):
                assert (model(ids) - want).abs().max() < ATOL, name
        rows = ["a", "b", None, "a"]
        with use_adapters(model, rows):
            mixed = model(ids)
    for i, name in enumerate(rows):
        assert (mixed[i] - expected[name][i]).abs().max() < ATOL, (i, name)
    save_adapter(model, "a", tmp_path / "saved", layout=checkpoint.adapter_layout)
    assert (hf_logits(peft_directory, tmp_path / "saved") - expected["a"]).abs().max() < ATOL


def test_token_head_adapters_give_peft_token_logits_alone_and_mixed_and_save_back(tmp_path):
    """TOKEN_CLS adapters on the token head (LoRA on head.dense, our pooler; their own ``classifier``): each real
    token's logits are PeftModel's in float32 and float64, alone and mixed per row; ours saved back load in PEFT."""
    from tests.model.test_hf_encoder_peft import assert_alone_and_mixed, hf_token_logits, real_token_logits

    pytest.importorskip("peft")
    directory = modernbert_directory(tmp_path / "hf", "token")
    paths = adapters(directory, tmp_path, auto="AutoModelForTokenClassification", task_type="TOKEN_CLS")
    for dtype, tolerance in ((torch.float32, ATOL), (torch.float64, 1e-9)):
        checkpoint = load_hf_checkpoint(directory, device="cpu", dtype=dtype)
        model = checkpoint.model
        for name, path in paths.items():
            load_adapter(model, path, name, layout=checkpoint.adapter_layout)
        assert isinstance(model.classifier, HeadCopies) and list(model.classifier.copies) == ["a", "b"]
        assert "pooler" in layers_with(model, "a")
        ids = transformers.AutoTokenizer.from_pretrained(directory)(TEXTS4, padding=True,
                                                                    return_tensors="pt")["input_ids"]
        expected = {name: hf_token_logits(directory, paths.get(name), dtype, TEXTS4) for name in ("a", "b", None)}
        assert all((expected[n] - expected[None]).abs().max() > 1e-2 for n in "ab")
        assert_alone_and_mixed(model, ids, expected, partial(real_token_logits, model), tolerance)
    save_adapter(model, "a", tmp_path / "saved", layout=checkpoint.adapter_layout)
    assert (hf_token_logits(directory, tmp_path / "saved", torch.float64, TEXTS4) - expected["a"]).abs().max() < 1e-9
