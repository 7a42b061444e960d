"""The README stays true: its two commands, the CI entry point and the configuration table."""

import os
import re
import subprocess
import sys
from pathlib import Path

from service.settings import settings_table

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_one():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make run", "make test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    targets = re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M)
    assert {"run", "test"} <= set(targets)


def test_configuration_table_matches_the_settings():
    assert settings_table().strip() in README


def test_the_packages_import_from_outside_the_repository(tmp_path):
    """README's Python example runs from any directory: the set-up installs the project into the venv
    (`pip install -e .` in the Makefile), not only the repository root's sys.path."""
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", README, re.S) if "model.checkpoint" in b)
    imports = "\n".join(line for line in snippet.splitlines() if line.startswith("from model"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", imports + "\nimport service.api.app, training.cli"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
