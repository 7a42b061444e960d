"""benchmarks/chat_turns.py at toy size (``--tiny``): conversations through /v1/chat/completions on the smollm2 shape
with a ChatML template, each turn resending the conversation; the turns after the first find the earlier turns in
the server's prefix cache, and the same conversations with the cache off find nothing and get the same replies.
Checks the bookkeeping and the cache's hits, never a latency."""

from benchmarks import chat_turns


def test_later_turns_of_a_conversation_hit_the_prefix_cache(tmp_path, capsys):
    report = chat_turns.main(["--tiny", "--cache", str(tmp_path / "shapes"), "--conversations", "2", "--turns", "3",
                              "--user-words", "6", "--reply-tokens", "5", "--compare-off"])
    on, off = report.on, report.off
    assert [t.turn for t in on.turns] == [1, 2, 3] and [len(t.replies) for t in on.turns] == [2, 2, 2]
    assert all(r.completion_tokens == 5 and r.ttft_s is not None and r.text for t in on.turns for r in t.replies)
    # every turn resends the conversation: its prompt holds the previous one's prompt and reply
    for before, after in zip(on.turns, on.turns[1:], strict=False):
        for a, b in zip(before.replies, after.replies, strict=True):
            assert b.prompt_tokens > a.prompt_tokens + a.completion_tokens
    # each turn finds at least the previous turn's prompt, in whole 16-token blocks (model/prefix_cache.py)
    for before, after in zip(on.turns, on.turns[1:], strict=False):
        assert after.hits >= 16 * sum(r.prompt_tokens // 16 for r in before.replies) > 0, (before, after)
    assert all(turn.hits == 0 for turn in off.turns)  # off: the hits above are the cache's
    text = capsys.readouterr().out
    assert "| turn | prompt tok (mean) |" in text and "TTFT p50 / max ms (cache off)" in text
