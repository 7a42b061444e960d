"""A calibrated classifier served: `python -m training calibrate --write` on the suite's trained classifier, then
its temperature applied to the served probabilities and its threshold answering "unknown" by default, which a
request's min_confidence replaces."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from model.checkpoint import load_checkpoint
from service.api.routes.models import model_schema
from tests.service.conftest import CLS, LM, running_engine
from tests.service.fixtures import write_labels
from training.cli import main


def test_the_command_calibrates_a_trained_classifier_and_the_checkpoint_loads_it(tmp_path, models_dir):
    """`python -m training calibrate --write` on the suite's trained classifier and a valid file of its task."""
    model = shutil.copytree(models_dir / CLS, tmp_path / CLS)
    valid = write_labels(tmp_path / "valid.jsonl", 7)
    assert main(["calibrate", "--model", str(model), "--valid", str(valid), "--max-rejected", "0.2", "--write"]) == 0
    calibration = load_checkpoint(model, device="cpu").calibration
    assert calibration is not None and calibration.temperature > 0 and 0 < calibration.min_confidence < 1
    assert calibration.report["rejected"] == pytest.approx(0.2, abs=0.05)
    assert main(["calibrate", "--model", str(models_dir / LM), "--valid", str(valid)]) == 1  # not a classifier



TEXTS = ["i love this", "the box is on the table", "this is awful", "it is fine i guess", "great great great"]


def test_the_served_classifier_applies_its_calibration(tmp_path, models_dir):
    root = tmp_path / "models"
    shutil.copytree(models_dir / CLS, root / CLS)
    (root / CLS / "calibration.json").write_text(json.dumps({"temperature": 2.5, "min_confidence": 0.5}))
    reference = load_checkpoint(models_dir / CLS, device="cpu")
    with torch.no_grad():
        probs = [torch.softmax(reference.model(torch.tensor([ids]), torch.tensor([seg]))[0] / 2.5, -1)
                 for ids, seg in (reference.tokenizer.encode_pair(t) for t in TEXTS)]

    async def main_():
        async with running_engine(root, None) as engine:
            worker = engine.get(CLS)
            assert worker.info.calibration == {"temperature": 2.5, "min_confidence": 0.5}
            assert model_schema(worker.info, 0).calibration == worker.info.calibration  # GET /v1/models
            by_default = await worker.classify(TEXTS, None, None, "default")
            never = await worker.classify(TEXTS, None, None, "never", min_confidence=0.0)
            always = await worker.classify(TEXTS, None, None, "always", min_confidence=1.0)
            return by_default, never, always

    by_default, never, always = asyncio.run(main_())
    labels = reference.labels
    for out, p, free in zip(by_default, probs, never, strict=True):
        assert out.score == pytest.approx(float(p.max()), abs=1e-5)  # softmax(logits / T)
        assert out.abstained == (float(p.max()) < 0.5)
        assert out.label == ("unknown" if out.abstained else labels[int(p.argmax())])
        assert not free.abstained and free.label == labels[int(p.argmax())]
    assert any(o.abstained for o in by_default) or all(float(p.max()) >= 0.5 for p in probs)
    assert all(o.abstained and o.label == "unknown" for o in always)
