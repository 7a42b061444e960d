"""How large a regular expression becomes once its counted repetitions are unrolled.

The grammar library (llguidance) accepts ``a{1000000}`` at compile time and expands it lazily: the first token it
consumes builds a million expressions and fails ("too many expressions constructed"), after the request was
accepted. :func:`unrolled_size` bounds that cost up front: atoms count 1, a sequence or an alternation the sum
of its parts, ``X{n}`` / ``X{n,m}`` / ``X{n,}`` the size of X times the largest count, and ``*``, ``+``, ``?``
nothing more (the library loops over them). The scan follows the library's syntax (Rust's ``regex``): escapes,
``\\p{..}``, ``\\x{..}``, nested character classes, ``(?flags:...)`` groups. It never raises: what it cannot
read it counts as atoms, and the library checks the syntax itself.
"""

from __future__ import annotations

import re

_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")
_HUGE = 10**9  # a count of more digits than this counts as this (int() refuses 4,300 digits)
_BRACED_ESCAPES = "pPxu"  # \p{Greek}, \x{10FFFF}, \u{...}: their braces are not counts


def unrolled_size(pattern: str) -> int:
    """The number of atoms ``pattern`` stands for with every counted repetition written out (a bound on the
    work its first derivative costs the grammar library)."""
    size, i = _alternation(pattern, 0)
    while i < len(pattern):  # past an unmatched ")": the library refuses it, but count the rest all the same
        more, i = _alternation(pattern, i + 1)
        size += more
    return size


def _alternation(pattern: str, i: int) -> tuple[int, int]:
    """Size of the alternation starting at ``i`` (up to an unmatched ``)`` or the end), and where it ends."""
    total, branch = 0, 0
    while i < len(pattern):
        char = pattern[i]
        if char == ")":
            break
        if char == "|":
            total, branch, i = total + branch, 0, i + 1
            continue
        atom, i = _atom(pattern, i)
        count, i = _quantifier(pattern, i)
        branch += atom * count
    return total + branch, i


def _atom(pattern: str, i: int) -> tuple[int, int]:
    char = pattern[i]
    if char == "(":
        inner, end = _alternation(pattern, i + 1)
        return max(inner, 1), end + 1  # past the ")" (or the end, unclosed)
    if char == "[":
        return 1, _class_end(pattern, i)
    if char == "\\" and i + 1 < len(pattern):
        if pattern[i + 1] in _BRACED_ESCAPES and pattern.startswith("{", i + 2):
            close = pattern.find("}", i + 3)
            return 1, len(pattern) if close < 0 else close + 1
        return 1, i + 2
    return 1, i + 1


def _class_end(pattern: str, i: int) -> int:
    """Just past the character class opened at ``i`` (classes nest; a leading ``]`` or ``^]`` is a literal)."""
    depth, i = 1, i + 1
    if pattern.startswith("^", i):
        i += 1
    if pattern.startswith("]", i):
        i += 1
    while i < len(pattern) and depth:
        char = pattern[i]
        if char == "\\":
            i += 1
        elif char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        i += 1
    return i


def _quantifier(pattern: str, i: int) -> tuple[int, int]:
    """The factor of the quantifiers at ``i`` (1 for none or ``* + ?``), and where they end."""
    factor = 1
    while i < len(pattern):
        if pattern[i] in "*+?":
            i += 1
            continue
        counted = _COUNT.match(pattern, i)
        if counted is None:
            break
        factor *= max(1, *(_number(digits) for digits in counted.groups() if digits))
        i = counted.end()
    return factor, i


def _number(digits: str) -> int:
    return int(digits) if len(digits) < 10 else _HUGE
