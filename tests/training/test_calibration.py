"""Temperature scaling and the "unknown" threshold (training/calibration.py) against naive float64 references;
tests/service/test_calibration.py runs the command on the suite's trained classifier and serves the result."""

from __future__ import annotations

import json
import math

import pytest
import torch

from model.calibration import Calibration, CalibrationError
from training.calibration import calibrate, expected_calibration_error, fit_temperature, nll


def overconfident(n: int = 4000, labels: int = 5, scale: float = 3.0, seed: int = 0):
    """Logits ``scale`` times sharper than the distribution the labels were drawn from."""
    generator = torch.Generator().manual_seed(seed)
    z = torch.randn(n, labels, generator=generator, dtype=torch.float64) * 1.5
    drawn = torch.multinomial(torch.softmax(z, -1), 1, generator=generator).squeeze(1)
    return z * scale, drawn


def test_the_fitted_temperature_minimizes_the_nll_and_recovers_the_sharpening():
    logits, labels = overconfident()
    fitted = fit_temperature(logits, labels)
    grid = [math.exp(x / 200) for x in range(-600, 601)]
    best = min(grid, key=lambda t: nll(logits, labels, t))
    assert nll(logits, labels, fitted) <= nll(logits, labels, best) + 1e-9
    assert fitted == pytest.approx(3.0, rel=0.1)  # the logits were 3x too sharp


def test_a_perfectly_separated_valid_split_leaves_the_temperature_at_1():
    logits = torch.tensor([[4.0, 0.0], [0.0, 3.0], [5.0, 1.0]], dtype=torch.float64)
    labels = torch.tensor([0, 1, 0])
    assert fit_temperature(logits, labels) is None  # the NLL falls all the way to T -> 0
    calibration = calibrate(logits, labels, max_rejected=0.0)
    assert calibration.temperature == 1.0 and not calibration.report["temperature_fitted"]


def test_ece_is_the_binned_confidence_accuracy_gap():
    logits, labels = overconfident(n=500)
    probs = torch.softmax(logits, -1)
    confidence, predicted = probs.max(-1)
    naive = 0.0
    for b in range(15):
        members = [i for i in range(len(labels)) if b / 15 < float(confidence[i]) <= (b + 1) / 15]
        if members:
            accuracy = sum(int(predicted[i] == labels[i]) for i in members) / len(members)
            mean_confidence = sum(float(confidence[i]) for i in members) / len(members)
            naive += len(members) / len(labels) * abs(accuracy - mean_confidence)
    assert expected_calibration_error(probs, labels) == pytest.approx(naive, abs=1e-12)


def test_calibration_lowers_the_ece_keeps_the_accuracy_and_rejects_the_share_asked():
    logits, labels = overconfident()
    calibration = calibrate(logits, labels, max_rejected=0.1)
    report = calibration.report
    assert report["ece_after"] < report["ece_before"] / 2 and report["nll_after"] < report["nll_before"]
    assert report["accuracy"] == pytest.approx(float((logits.argmax(-1) == labels).double().mean()))
    assert report["rejected"] == pytest.approx(0.1, abs=0.01)
    assert report["accuracy_of_accepted"] >= report["accuracy"]  # the least confident go first
    assert calibrate(logits, labels, max_rejected=0.0).min_confidence == 0.0


def test_a_calibration_file_round_trips_and_bad_values_are_named(tmp_path):
    Calibration(2.5, 0.4, {"examples": 3}).save(tmp_path)
    assert Calibration.load(tmp_path) == Calibration(2.5, 0.4, {"examples": 3})
    assert Calibration.load(tmp_path / "missing") is None
    (tmp_path / "calibration.json").write_text('{"temperature": -1, "min_confidence": 0.2}')
    with pytest.raises(CalibrationError, match="temperature"):
        Calibration.load(tmp_path)



@pytest.mark.parametrize(("head", "activation"), [("multi", "sigmoid"), ("regression", "none")])
def test_a_classifier_without_a_softmax_is_refused_by_name(head, activation, tmp_path):
    """The temperature is a softmax's: a multi-label or regression model (problem_type) is not calibrated."""
    pytest.importorskip("transformers")
    from tests.model.hf_encoders import encoder_directory
    from training.calibration import load_classifier

    directory = encoder_directory(tmp_path, "distilbert", head)
    with pytest.raises(ValueError, match=f"output_activation='{activation}', but calibration fits"):
        load_classifier(directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "problem_type": "single_label_classification"}))
    assert load_classifier(directory).config.output_activation == "softmax"
