"""Package names that training.corpora.PackageHoldout holds out, found with the rule itself."""

from __future__ import annotations

from itertools import product
from string import ascii_lowercase

from training.corpora import PackageHoldout


def package_in(split: str | None) -> str:
    """The first three-letter package name (a group of its own) that PackageHoldout() sends to ``split`` (None: not
    held out)."""
    for letters in product(ascii_lowercase, repeat=3):
        name = "".join(letters)
        if PackageHoldout().split_of(name) == split:
            return name
    raise AssertionError(f"no three-letter package goes to {split}")
