"""``torchrun ... -m tests.training.digest_train DIR train FAMILY <flags>``: `train`, then each rank writes the SHA-256
of the parameters it trained to ``DIR/rank<N>.sha256`` (the DDP replicas must agree)."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from torch import nn

from tests.training.conftest import parse_run
from training.runs import TrainRun
from training.train_run import train


def digest(model: nn.Module) -> str:
    """A hash of every tensor of ``model``'s state, by name."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(directory: str, *argv: str) -> None:
    model = train(parse_run(TrainRun, *argv))
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{os.environ['RANK']}.sha256").write_text(digest(model) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
