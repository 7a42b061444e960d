"""The README stays true: its two commands, the CI entry point and the configuration table."""

import re
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
