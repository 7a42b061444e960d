"""`python -m training calibrate`: the command line (work in training.calibration)."""

from __future__ import annotations

import argparse
import json
import sys

from training.errors import UserError
from training.runs import CalibrateRun, command


def _run(run: CalibrateRun) -> None:
    from training.calibration import calibrate_checkpoint

    if not 0 <= run.max_rejected < 1:
        raise UserError(f"--max-rejected must be in [0, 1), got {run.max_rejected}")
    try:
        calibration = calibrate_checkpoint(run.model, run.valid, run.max_rejected)
    except (ValueError, OSError) as exc:
        raise UserError(str(exc)) from None
    result = {"temperature": calibration.temperature, "min_confidence": calibration.min_confidence,
              **calibration.report}
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
    if run.write:
        sys.stdout.write(f"wrote {calibration.save(run.model)}\n")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `calibrate`."""
    p = subparsers.add_parser(
        "calibrate",
        help="fit a classifier's temperature and its \"unknown\" threshold on the valid split",
        description="Temperature scaling on the valid split (the expected calibration error before and after), "
        "and the calibrated confidence below which --max-rejected of the valid texts fall: the model's default "
        "threshold for answering \"unknown\" (training/calibration.py). --write stores both in the checkpoint's "
        "calibration.json, which the service applies.",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="classifier checkpoint")
    p.add_argument("--valid", required=True, metavar="FILE", help="valid split (.tsv text<TAB>label or .jsonl)")
    p.add_argument("--max-rejected", type=float, default=0.05,
                   help="share of valid texts the threshold may reject (default 0.05)")
    p.add_argument("--write", action="store_true", help="write calibration.json into the checkpoint")
    p.set_defaults(func=command(CalibrateRun, _run))
