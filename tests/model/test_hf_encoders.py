"""RoBERTa, XLM-RoBERTa and DistilBERT directories as our classifier (model/hf/roberta.py, distilbert.py), saved by
`transformers` itself with random weights (tests/model/hf_encoders.py).

Each architecture as a headless model (hidden states, the cls / mean / max embeddings) and as a
*ForSequenceClassification of every problem_type (single-label, multi-label, regression, one label: a cross-encoder),
on a batch of right-padded rows and a left-padded one (RoBERTa counts positions from the ids): equal to transformers
within 1e-4 in float32 and 1e-9 in float64, in the layers (float64) and the C++ encoder (float32 inference); what
classify serves is softmax, each label's sigmoid or the raw value as transformers' text-classification pipeline
applies them; int8 stays close to float32. Each of them and BERT as a *ForTokenClassification: every real token's
logits equal transformers' (token_logits), its adapters refused by name.
"""

from __future__ import annotations

import json

import pytest
import torch

from model import int8_kernel
from model.classifier import label_scores
from model.fast_step import plan_for
from model.hf import HFImportError, load_hf_model
from model.quantize import quantize_int8
from tests.hf_compare import ATOL
from tests.model.hf_encoders import ARCHITECTURES, ENCODERS, HEADS, TOKEN_HEADS, save

transformers = pytest.importorskip("transformers")

# head -> what classify serves of the logits (transformers' text-classification pipeline's rule; None: headless)
SERVES = {"model": None, "single": lambda x: torch.softmax(x, -1), "multi": torch.sigmoid,
          "regression": lambda x: x, "one-label": torch.sigmoid}
ROWS = [[10, 11, 12, 13, 14, 15, 16], [20, 21, 22], [30, 31, 32, 33, 34]]


def batch(pad: int) -> torch.Tensor:
    """Right-padded rows, and the last row left-padded (its positions must still start after the pad offset)."""
    width = max(map(len, ROWS)) + 1
    right = [[5, *r, 6] + [pad] * (width - len(r) - 1) for r in ROWS[:-1]]
    left = [[pad] * (width - len(ROWS[-1]) - 1) + [5, *ROWS[-1], 6]]
    return torch.tensor(right + left)


def theirs_forward(model, dtype: torch.dtype, ids: torch.Tensor, pad: int):
    with torch.no_grad():
        return model.to(dtype)(input_ids=ids, attention_mask=(ids != pad).long())


@pytest.mark.parametrize("head", SERVES)
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_encoders_equal_transformers_on_padded_batches(tmp_path, architecture, head):
    theirs = save(tmp_path / "hf", architecture, head)
    pad = ARCHITECTURES[architecture][3]
    ids = batch(pad)
    serves = SERVES[head]
    for dtype, tolerance in ((torch.float32, ATOL), (torch.float64, 1e-9)):
        ours, config = load_hf_model(tmp_path / "hf", dtype)
        expected = theirs_forward(theirs, dtype, ids, pad)
        with torch.inference_mode():  # float32: the C++ encoder where it runs
            if serves is None:
                hidden, _ = ours.encode(ids)
                got, want = hidden, expected.last_hidden_state
            else:
                logits = ours(ids)
                got, want = label_scores(logits, config.output_activation), serves(expected.logits)
                assert (logits - expected.logits).abs().max() < tolerance, (dtype, "logits")
        assert (got - want).abs().max() < tolerance, (dtype, float((got - want).abs().max()))
    assert config.num_labels == (0 if serves is None else expected.logits.shape[-1])
    if serves is None:
        _embeddings_equal(ours, ids, pad, theirs_forward(theirs, torch.float64, ids, pad).last_hidden_state)


@pytest.mark.parametrize("architecture", TOKEN_HEADS)
def test_token_heads_equal_transformers_on_padded_batches(tmp_path, architecture):
    """*ForTokenClassification: every real token's logits (the pads' are the caller's to drop), without a pooler;
    the sequence forward is refused by name, as token_logits is on a sequence classifier."""
    theirs = save(tmp_path / "hf", architecture, "token")
    pad = ENCODERS[architecture][3]
    ids = batch(pad)
    real = ids != pad
    for dtype, tolerance in ((torch.float32, ATOL), (torch.float64, 1e-9)):
        ours, config = load_hf_model(tmp_path / "hf", dtype)
        want = theirs_forward(theirs, dtype, ids, pad).logits
        with torch.inference_mode():
            got = ours.token_logits(ids)
        assert got.shape == want.shape
        assert (got - want)[real].abs().max() < tolerance, (dtype, float((got - want)[real].abs().max()))
    assert (config.head, config.pooler, config.num_labels) == ("token", False, len(HEADS["token"]["id2label"]))
    with pytest.raises(ValueError, match="token classification head"):
        ours(ids)
    save(tmp_path / "seq", architecture, "single")
    sequence, _ = load_hf_model(tmp_path / "seq")
    with pytest.raises(ValueError, match="no token classification head"):
        sequence.token_logits(ids)


def _embeddings_equal(ours, ids: torch.Tensor, pad: int, hidden: torch.Tensor) -> None:
    """cls / mean / max pooling (sentence-transformers' rules) over transformers' float64 hidden states (cls on the
    right-padded rows: a left-padded row's first token is a pad)."""
    keep = (ids != pad).unsqueeze(-1)
    reference = {"cls": hidden[:-1, 0], "mean": (hidden * keep).sum(1) / keep.sum(1),
                 "max": torch.where(keep, hidden, torch.tensor(-1e9, dtype=hidden.dtype)).amax(1)}
    for pooling, want in reference.items():
        with torch.no_grad():
            got = ours.embed_texts(ids[: len(want)], pooling=pooling)
        assert (got - want).abs().max() < 1e-9, pooling


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_int8_encoders_stay_close_to_float32_in_the_cpp_encoder(tmp_path, architecture):
    """The same blocks as BERT: the int8 model runs the C++ encoder plan, within int8 rounding of float32."""
    save(tmp_path / "hf", architecture, "single", seed=1)
    ids = batch(ARCHITECTURES[architecture][3])
    model, _ = load_hf_model(tmp_path / "hf")
    with torch.inference_mode():
        want = model(ids)
    try:
        quantize_int8(model)
    except ValueError as exc:  # QuantizeError: no int8 kernel on this machine
        pytest.skip(str(exc))
    with torch.inference_mode():
        got = model(ids)
    assert int8_kernel.kernel() is None or plan_for(model.encoder).native is not None
    assert (got - want).abs().max() < 0.1 * want.abs().max(), float((got - want).abs().max())  # 1-4% measured


@pytest.mark.parametrize(
    ("architecture", "overrides", "says"),
    [
        ("roberta", {"position_embedding_type": "relative_key"}, "position_embedding_type='relative_key' is not"),
        ("roberta", {"problem_type": "ranking"}, "problem_type='ranking' is not supported"),
        ("roberta", {"max_position_embeddings": 2}, "max_position_embeddings=2 leaves no position"),
        ("distilbert", {"activation": "quick_gelu"}, "activation='quick_gelu' is not supported"),
        ("distilbert", {"dim": 48}, "'embeddings.word_embeddings.weight' has shape (64, 32), expected (64, 48)"),
    ],
)
def test_encoder_config_fields_we_cannot_express_are_refused_by_name(tmp_path, architecture, overrides, says):
    save(tmp_path / "hf", architecture, "single")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **overrides}))
    with pytest.raises(HFImportError, match=says.replace("(", r"\(").replace(")", r"\)")):
        load_hf_model(tmp_path / "hf")
