"""benchmarks/open_loop.py on a Llama-style decoder shape of benchmarks/shapes.py (``--shape smollm2-135m``) with a
shared system prompt (``--system-words``): the plan's prompts, and a tiny real run of the shape's HF directory.

The real run serves the shape at toy sizes (``--tiny``, built into tmp_path) with ``python -m service`` and checks
the report's bookkeeping and the prefix cache's hits, never a latency or throughput value.
"""

import pytest

from benchmarks import open_loop, open_loop_load
from benchmarks.open_loop_load import LoadConfig


def _config(system_words: int) -> LoadConfig:
    return LoadConfig(duration_s=20.0, seed=5, prompt_words=(2, 9), output_tokens=(4, 12), max_in_flight=8,
                      drain_s=1.0, system_words=system_words)


def test_a_system_prompt_opens_every_prompt_before_the_same_drawn_words():
    words = [f"w{i}" for i in range(500)]
    plain, chat = (open_loop_load.plan_requests(2.0, _config(n), words) for n in (0, 7))
    assert len(chat) == len(plain) > 1
    system = "w0 w1 w2 w3 w4 w5 w6 "
    for a, b in zip(plain, chat, strict=True):
        assert b.prompt == system + a.prompt  # the same passage, then request i's own drawn words
        assert (b.arrival_s, b.prompt_words, b.output_tokens) == (a.arrival_s, a.prompt_words, a.output_tokens)
    assert len({r.prompt for r in chat}) > 1


@pytest.mark.parametrize("prefix_cache_mb", [None, 0])
def test_a_tiny_smollm2_shape_serves_chat_prompts_and_the_prefix_cache_finds_the_system_prompt(
        tmp_path, capsys, prefix_cache_mb):
    cache_option = [] if prefix_cache_mb is None else ["--prefix-cache-mb", str(prefix_cache_mb)]
    report = open_loop.main(["--shape", "smollm2-135m", "--tiny", "--cache", str(tmp_path / "shapes"),
                             "--rates", "3", "--duration", "2", "--drain", "60", "--system-words", "12",
                             "--prompt-words", "2", "8", "--output-tokens", "2", "6", "--seed", "2", *cache_option])
    assert report.model == "smollm2-135m"
    [result] = report.results
    assert len(result.completed) == result.planned > 0, result.first_error
    assert all(len(q.token_times) == q.planned.output_tokens for q in result.completed)
    # 12 words of this tokenizer are over one 16-token block: the warm-up request cached them for every request
    assert result.prompt_tokens >= result.planned * (12 + 2)
    if prefix_cache_mb is None:
        assert 0 < result.prefix_hit_rate < 1
    else:
        assert not result.prefix_hit_rate  # off: nothing looked up, or nothing found
    text = capsys.readouterr().out
    assert "'smollm2-135m' (causal_lm), benchmarks/shapes.py's smollm2-135m shape at toy sizes" in text
    assert "the same 12-word system prompt" in text
