"""training.generation_tuning's loop detector and choice rule (the recipe test runs the whole tuning on a model
trained by the recipe)."""

from __future__ import annotations

import random

from training.generation_tuning import LOOP_MAX_PERIOD, LOOP_WINDOW, Score, Setting, choose, is_loop


def test_a_loop_is_a_tail_repeating_with_a_short_period():
    rng = random.Random(0)
    noise = [rng.randrange(1000) for _ in range(40)]
    assert is_loop(noise + [7, 8] * 12)  # 'w, 'w, 'w
    assert is_loop(noise + [5] * LOOP_WINDOW)
    unit = list(range(100, 100 + LOOP_MAX_PERIOD))
    assert is_loop(noise + unit * 3)  # the longest unit
    assert not is_loop(noise + list(range(200, 200 + LOOP_MAX_PERIOD + 1)) * 3)  # a longer unit is not a loop
    assert not is_loop(noise)
    assert not is_loop([7, 8] * (LOOP_WINDOW // 2 - 1))  # shorter than the window
    assert not is_loop(noise + [7, 8] * 11 + [9, 8])  # broken at its last token


def test_the_choice_is_the_best_chrf_among_settings_that_halve_the_loop_rate():
    plain = Score(Setting(1.0, 0), 0.40, 10.0)
    scores = [plain, Score(Setting(1.1, 0), 0.25, 30.0), Score(Setting(1.3, 0), 0.10, 17.0),
              Score(Setting(1.5, 0), 0.0, 15.0)]
    assert choose(scores) == Setting(1.3, 0)  # 1.1 has the best chrF but does not halve 40%
    assert choose([plain, Score(Setting(1.1, 0), 0.3, 20.0)]) == Setting(1.0, 0)  # nothing halves it
    assert choose([Score(Setting(1.0, 0), 0.0, 10.0), Score(Setting(1.3, 0), 0.0, 12.0)]) == Setting(1.0, 0)
