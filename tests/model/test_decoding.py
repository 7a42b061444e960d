"""Decoding searches against a toy LM whose logits depend on each row's whole history."""

import math
from collections import Counter

import pytest
import torch

from model.decoding import GenerationConfig, make_search
from model.logits import apply_top_k, apply_top_p, repeated_ngram_bans, top_k
from model.search import Hypothesis, run_search
from tests.hf_compare import repeats_ngram

EOS = 2


class ToyLM:
    """Logits = a fixed random table row picked by a hash of the row's history (prompt + tokens).

    EOS gets a bonus growing with length, so rows finish at different steps; a wrong cache reorder
    in `select_rows` changes the hash and therefore the output.
    """

    def __init__(self, vocab: int = 6, seed: int = 0, eos_slope: float = 0.6, scale: float = 2.0,
                 buckets: int = 997):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(buckets, vocab, generator=g) * scale
        self.eos_slope = eos_slope
        self.buckets = buckets

    def logits(self, history: torch.Tensor) -> torch.Tensor:
        """(R, T) token history -> (R, V) logits."""
        h = torch.zeros(history.size(0), dtype=torch.long)
        for t in range(history.size(1)):
            h = (h * 31 + history[:, t] + 1) % self.buckets
        logits = self.table[h].clone()
        logits[:, EOS] += self.eos_slope * history.size(1) - 2.0
        return logits


def generate(model: ToyLM, prompts: list[int], config: GenerationConfig, stop_fn=None, row_counts=None):
    """Offline generation with run_search; the per-row history tensor plays the KV cache."""
    search = make_search(config, len(prompts), stop_fn, prefixes=[[p] for p in prompts])
    state = {"history": torch.tensor(prompts)[:, None]}

    def step(tokens: torch.Tensor) -> torch.Tensor:
        state["history"] = torch.cat([state["history"], tokens[:, None]], dim=1)
        if row_counts is not None:
            row_counts.append(tokens.numel())
        return model.logits(state["history"])

    def select_rows(parents: torch.Tensor, tails: torch.Tensor | None) -> None:
        if tails is not None:  # the rows' histories agree with their parents' but for their last `tails` tokens
            history, parent = state["history"], state["history"][parents]
            for row, tail in enumerate(tails.tolist()):
                assert torch.equal(history[row, : history.shape[1] - tail], parent[row, : history.shape[1] - tail])
        state["history"] = state["history"][parents]

    return run_search(search, model.logits(state["history"]), step, select_rows)


def naive_greedy(model: ToyLM, prompt: int, max_new: int, min_new: int = 0) -> tuple[list[int], float, str]:
    history, logprob = [prompt], 0.0
    for i in range(max_new):
        lp = torch.log_softmax(model.logits(torch.tensor([history]))[0], dim=-1)
        if i < min_new:
            lp[EOS] = -math.inf
        token = int(lp.argmax())
        logprob += float(lp[token])
        if token == EOS:
            return history[1:], logprob, "eos"
        history.append(token)
    return history[1:], logprob, "length"


def exhaustive(model: ToyLM, prompt: int, max_new: int, alpha: float) -> list[tuple[float, list[int]]]:
    """Every finished sequence (EOS within max_new tokens, or max_new tokens) scored logprob / length ** alpha."""
    out = []

    def visit(history: list[int], logprob: float) -> None:
        lp = torch.log_softmax(model.logits(torch.tensor([history]))[0], dim=-1).double().tolist()
        n = len(history)  # tokens generated after this one
        for token, value in enumerate(lp):
            total = logprob + value
            if token == EOS or n == max_new:
                kept = history[1:] + ([] if token == EOS else [token])
                out.append((total / n ** alpha, kept))
            else:
                visit(history + [token], total)

    visit([prompt], 0.0)
    return sorted(out, key=lambda x: -x[0])


def naive_beam(model: ToyLM, prompt: int, config: GenerationConfig) -> list[tuple[float, list[int], str]]:
    """Per-sentence beam search with plain lists, after transformers' `_beam_search` (5.x): 2 x beams
    candidates, of which the top `beams` may finish; at the length limit they all do; HF's stopping rules."""
    beams_n, max_new = config.num_beams, config.max_new_tokens
    alpha, early = config.length_penalty, config.early_stopping
    beams, finished = [([], 0.0)], []
    for step in range(1, max_new + 1):
        candidates = []
        for tokens, total in beams:
            lp = torch.log_softmax(model.logits(torch.tensor([[prompt] + tokens]))[0], dim=-1).tolist()
            candidates += [(total + value, tokens, token) for token, value in enumerate(lp)]
        candidates = sorted(candidates, key=lambda c: -c[0])[: 2 * beams_n]
        for total, tokens, token in candidates[:beams_n]:
            if token == EOS:
                finished.append((total / step ** alpha, tokens, "eos"))
            elif step == max_new:
                finished.append((total / step ** alpha, tokens + [token], "length"))
        finished = sorted(finished, key=lambda f: -f[0])[:beams_n]
        if step == max_new:
            break
        live = [(tokens + [token], total) for total, tokens, token in candidates if token != EOS][:beams_n]
        if len(finished) >= beams_n:
            length = max_new if early == "never" and alpha > 0 else step
            if early is True or live[0][1] / length ** alpha <= finished[-1][0]:
                break
        beams = live
    return finished[: config.num_return_sequences]


PROMPTS = [0, 1, 3, 4, 5]


# ---- greedy ------------------------------------------------------------------------------------

@pytest.mark.parametrize("max_new", [4, 8])
def test_greedy_matches_naive_loop_and_batch_matches_alone(max_new):
    model, config = ToyLM(), GenerationConfig(max_new_tokens=max_new)
    batched = generate(model, PROMPTS, config)
    for prompt, hyps in zip(PROMPTS, batched, strict=True):
        (hyp,) = hyps
        tokens, logprob, reason = naive_greedy(model, prompt, max_new)
        assert (hyp.tokens, hyp.finish_reason) == (tokens, reason)
        assert hyp.logprob == pytest.approx(logprob, abs=1e-5) and hyp.score == hyp.logprob
        assert generate(model, [prompt], config) == [hyps]
    assert len({len(h[0].tokens) for h in batched}) > 1, "inputs should finish at different steps"


def test_finished_rows_leave_the_batch():
    counts: list[int] = []
    generate(ToyLM(), PROMPTS, GenerationConfig(max_new_tokens=8), row_counts=counts)
    assert counts[0] == len(PROMPTS) and counts == sorted(counts, reverse=True) and counts[-1] < counts[0]


def test_bf16_logits_and_done_search():
    search = make_search(GenerationConfig(max_new_tokens=1), 2)
    with pytest.raises(RuntimeError):
        search.results()
    with pytest.raises(ValueError, match="num_rows"):
        search.advance(torch.zeros(3, 6))
    tokens, parents = search.advance(torch.randn(2, 6).bfloat16())
    assert search.done and tokens.numel() == parents.numel() == 0
    assert search.advance(torch.zeros(0, 6))[0].numel() == 0
    assert all(isinstance(h[0].logprob, float) and h[0].finish_reason for h in search.results())


def test_min_new_tokens_blocks_eos():
    model = ToyLM(eos_slope=3.0)
    free = generate(model, PROMPTS, GenerationConfig(max_new_tokens=8))
    assert min(len(h[0].tokens) for h in free) < 3
    for strategy in ("greedy", "beam", "sample"):
        config = GenerationConfig(strategy=strategy, max_new_tokens=8, min_new_tokens=3, seed=0)
        for hyps in generate(model, PROMPTS, config):
            assert all(len(h.tokens) >= 3 and EOS not in h.tokens[:3] for h in hyps)
    for prompt, hyps in zip(PROMPTS, generate(model, PROMPTS, GenerationConfig(min_new_tokens=3)), strict=True):
        assert hyps[0].tokens == naive_greedy(model, prompt, 64, min_new=3)[0]


def test_stop_tokens_end_with_stop_and_are_not_kept():
    model, config = ToyLM(), GenerationConfig(max_new_tokens=8)
    plain = generate(model, PROMPTS, config)
    prompt_index, hyp = next((i, h[0]) for i, h in enumerate(plain) if len(h[0].tokens) >= 3)
    stop = hyp.tokens[2]
    cut = hyp.tokens.index(stop)
    (stopped,) = generate(model, [PROMPTS[prompt_index]], GenerationConfig(max_new_tokens=8, stop_token_ids=(stop,)))
    assert stopped[0].tokens == hyp.tokens[:cut] and stopped[0].finish_reason == "stop"
    beam = generate(model, PROMPTS, GenerationConfig(strategy="beam", max_new_tokens=8, stop_token_ids=(stop,)))
    assert all(stop not in h.tokens for hyps in beam for h in hyps)


@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS + [6, 7, 8, 9, 10]], ids=["few-rows", "tensor-codes"])
def test_stop_fn_ends_its_input_with_stop(prompts):
    model, config = ToyLM(eos_slope=0.0), GenerationConfig(max_new_tokens=8)
    plain = generate(model, prompts, config)
    calls = []

    def stop_fn(input_index: int, tokens: list[int]) -> bool:
        calls.append((input_index, list(tokens)))
        return input_index == 1 and len(tokens) >= 2

    stopped = generate(model, prompts, config, stop_fn=stop_fn)
    assert stopped[1][0].tokens == plain[1][0].tokens[:2] and stopped[1][0].finish_reason == "stop"
    assert [h for i, h in enumerate(stopped) if i != 1] == [h for i, h in enumerate(plain) if i != 1]
    for input_index, tokens in calls:  # the hook sees its own input's tokens so far
        assert plain[input_index][0].tokens[: len(tokens)] == tokens
    assert {i for i, _ in calls} == set(range(len(prompts)))
    with pytest.raises(ValueError, match="stop_fn"):
        make_search(GenerationConfig(strategy="beam"), 1, stop_fn=stop_fn)


# ---- beam --------------------------------------------------------------------------------------

@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_beam_one_equals_greedy(alpha):
    model = ToyLM()
    greedy = generate(model, PROMPTS, GenerationConfig(max_new_tokens=8))
    beam = generate(model, PROMPTS, GenerationConfig(strategy="beam", num_beams=1, max_new_tokens=8,
                                                     length_penalty=alpha))
    for g, b in zip(greedy, beam, strict=True):  # the log-probs by two routes (greedy_choice, log_softmax)
        assert (b[0].tokens, b[0].finish_reason) == (g[0].tokens, g[0].finish_reason)
        assert b[0].logprob == pytest.approx(g[0].logprob, abs=1e-5)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
@pytest.mark.parametrize("early_stopping", [True, "never"])  # False's heuristic may stop short of the optimum
def test_full_width_beam_equals_exhaustive_search(alpha, early_stopping):
    vocab, max_new = 5, 4
    model, prompts = ToyLM(vocab=vocab, eos_slope=0.3, scale=1.0), [0, 1, 4]
    width = (vocab - 1) ** (max_new - 1) * vocab  # every candidate of the last step: nothing is pruned
    config = GenerationConfig(strategy="beam", num_beams=width, max_new_tokens=max_new, length_penalty=alpha,
                              early_stopping=early_stopping, num_return_sequences=5)
    greedy = GenerationConfig(strategy="beam", num_beams=1, max_new_tokens=max_new, length_penalty=alpha)
    best = [exhaustive(model, prompt, max_new, alpha)[:5] for prompt in prompts]
    assert any(g[0].tokens != b[0][1] for g, b in zip(generate(model, prompts, greedy), best, strict=True)), \
        "the toy model should fool greedy for some prompt"
    for hyps, expected in zip(generate(model, prompts, config), best, strict=True):
        assert [h.tokens for h in hyps] == [tokens for _, tokens in expected]
        assert [h.score for h in hyps] == pytest.approx([score for score, _ in expected], abs=1e-5)


@pytest.mark.parametrize("alpha", [-1.0, 0.0, 1.0, 2.0])
@pytest.mark.parametrize("early_stopping", [True, False, "never"])
@pytest.mark.parametrize("beams, scale", [(2, 2.0), (3, 1.0)])
def test_beam_matches_naive_reference(alpha, early_stopping, beams, scale):
    model = ToyLM(eos_slope=0.5, scale=scale)
    config = GenerationConfig(strategy="beam", num_beams=beams, num_return_sequences=beams, max_new_tokens=10,
                              length_penalty=alpha, early_stopping=early_stopping)
    for prompt, hyps in zip(PROMPTS, generate(model, PROMPTS, config), strict=True):
        expected = naive_beam(model, prompt, config)
        assert [(h.tokens, h.finish_reason) for h in hyps] == [(tokens, reason) for _, tokens, reason in expected]
        assert [h.score for h in hyps] == pytest.approx([score for score, _, _ in expected], abs=1e-5)


def test_beam_over_a_large_vocabulary_matches_naive_reference():
    """4 beams x 6000 tokens: the candidates come from top_k's chunked search, not torch.topk."""
    model = ToyLM(vocab=6000, eos_slope=3.0, scale=3.0)
    config = GenerationConfig(strategy="beam", num_beams=4, num_return_sequences=4, max_new_tokens=6)
    for prompt, hyps in zip(PROMPTS, generate(model, PROMPTS, config), strict=True):
        expected = naive_beam(model, prompt, config)
        assert [(h.tokens, h.finish_reason) for h in hyps] == [(tokens, reason) for _, tokens, reason in expected]
        assert [h.score for h in hyps] == pytest.approx([score for score, _, _ in expected], abs=1e-5)


@pytest.mark.parametrize("rows, columns, k", [(3, 32000, 8), (2, 40003, 5), (4, 100, 3)])
def test_top_k_equals_torch_topk(rows, columns, k):
    scores = torch.randn(rows, columns, generator=torch.Generator().manual_seed(columns))
    scores[0, -1] = 10.0  # the best value in the partial last chunk
    scores[1, :5000] = -math.inf  # whole chunks of -inf
    values, indices = top_k(scores, k)
    expected = scores.topk(k, dim=1)
    assert torch.equal(values, expected.values) and torch.equal(indices, expected.indices)
    dead = torch.full((1, 32000), -math.inf)
    values, indices = top_k(dead, k)  # all equal: any k columns, each holding the value it reports
    assert torch.equal(values, dead[:, :k]) and torch.equal(dead.gather(1, indices), values)
    assert indices.unique().numel() == k


def test_beam_nbest_sorted_distinct_and_reasons():
    model, max_new = ToyLM(), 6
    config = GenerationConfig(strategy="beam", num_beams=4, num_return_sequences=3, max_new_tokens=max_new)
    results = generate(model, PROMPTS, config)
    reasons = set()
    for hyps in results:
        assert len(hyps) == 3
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        assert len({tuple(h.tokens) for h in hyps}) == 3
        for h in hyps:
            reasons.add(h.finish_reason)
            penalty = (len(h.tokens) + (h.finish_reason == "eos")) ** config.length_penalty
            assert h.score == pytest.approx(h.logprob / penalty)
            assert (len(h.tokens) == max_new) == (h.finish_reason == "length")
            assert EOS not in h.tokens
    assert reasons == {"eos", "length"}


def test_beam_batch_equals_alone_and_rows_leave():
    model = ToyLM()
    config = GenerationConfig(strategy="beam", num_beams=3, num_return_sequences=2, max_new_tokens=10)
    counts: list[int] = []
    batched = generate(model, PROMPTS, config, row_counts=counts)
    assert batched == [generate(model, [p], config)[0] for p in PROMPTS]
    assert counts[0] == 3 * len(PROMPTS) and counts[-1] < counts[0] and all(c % 3 == 0 for c in counts)


def test_beam_without_early_stopping_searches_on_and_never_scores_worse():
    model, differ = ToyLM(eos_slope=0.5, scale=1.0), 0
    for prompt in PROMPTS:
        runs = [generate(model, [prompt], GenerationConfig(strategy="beam", num_beams=3, max_new_tokens=10,
                                                           length_penalty=2.0, early_stopping=early))[0][0]
                for early in (True, False, "never")]  # each searches at least as long as the one before
        assert runs[2].score >= runs[1].score - 1e-6 and runs[1].score >= runs[0].score - 1e-6
        differ += runs[2].tokens != runs[0].tokens
    assert differ > 0


# ---- repetition_penalty -------------------------------------------------------------------------


def test_the_repetition_penalty_rescores_held_tokens_as_transformers_does():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from model.logits import penalize_repeats

    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(4, 30, generator=generator) * 3
    sequences = torch.randint(0, 30, (4, 7), generator=generator)
    for penalty in (0.7, 1.5):
        want = RepetitionPenaltyLogitsProcessor(penalty)(sequences, scores.clone())
        assert torch.equal(penalize_repeats(scores.clone(), sequences.tolist(), penalty), want)
    assert torch.equal(penalize_repeats(scores.clone(), [[]] * 4, 1.5), scores)  # nothing held, nothing changed


# ---- no_repeat_ngram_size ----------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3])
def test_repeated_ngram_bans_are_the_tokens_that_would_repeat_an_ngram(n):
    g = torch.Generator().manual_seed(n)
    for length in range(0, 12):
        sequence = torch.randint(0, 4, (length,), generator=g).tolist()
        (banned,) = repeated_ngram_bans([sequence], n)
        grams = {tuple(sequence[i: i + n]) for i in range(len(sequence) - n + 1)}
        expected = {t for t in range(4) if len(sequence) + 1 >= n and tuple((sequence + [t])[-n:]) in grams}
        assert set(banned) == expected, (sequence, banned)


@pytest.mark.parametrize("strategy", ["greedy", "sample", "beam"])
def test_no_repeat_ngram_size_keeps_every_ngram_of_prefix_and_output_unique(strategy):
    model = ToyLM(vocab=12, eos_slope=0.05, scale=3.0)
    kwargs = dict(strategy=strategy, max_new_tokens=10, seed=1, num_return_sequences=2)
    if strategy == "greedy":
        kwargs.pop("num_return_sequences")
    plain = generate(model, PROMPTS, GenerationConfig(**kwargs))
    ruled = generate(model, PROMPTS, GenerationConfig(no_repeat_ngram_size=2, **kwargs))
    assert any(repeats_ngram([p, *h.tokens], 2) for p, hyps in zip(PROMPTS, plain, strict=True) for h in hyps)
    assert not any(repeats_ngram([p, *h.tokens], 2) for p, hyps in zip(PROMPTS, ruled, strict=True) for h in hyps)
    with pytest.raises(ValueError, match="needs the prefix"):
        make_search(GenerationConfig(no_repeat_ngram_size=2, **kwargs), 2)


# ---- sampling ----------------------------------------------------------------------------------

def test_seeded_sampling_is_reproducible_alone_and_in_a_batch():
    model = ToyLM(eos_slope=0.3)
    config = GenerationConfig(strategy="sample", max_new_tokens=10, seed=7, num_return_sequences=3)
    batched = generate(model, PROMPTS, config)
    assert batched == generate(model, PROMPTS, config)
    for i, prompt in enumerate(PROMPTS):  # input i of a search seeded s samples as a search seeded s + i
        assert generate(model, [prompt], GenerationConfig(strategy="sample", max_new_tokens=10, seed=7 + i,
                                                          num_return_sequences=3)) == [batched[i]]
        assert len(batched[i]) == 3
    outputs = {tuple(h.tokens) for hyps in batched for h in hyps}
    assert len(outputs) > len(PROMPTS), "samples should differ"


@pytest.mark.parametrize("overrides", [dict(temperature=1e-4), dict(top_k=1), dict(top_p=1e-6)])
def test_degenerate_sampling_equals_greedy(overrides):
    model = ToyLM()
    greedy = generate(model, PROMPTS, GenerationConfig(max_new_tokens=8))
    sampled = generate(model, PROMPTS, GenerationConfig(strategy="sample", max_new_tokens=8, **overrides))
    for g, s in zip(greedy, sampled, strict=True):
        assert (s[0].tokens, s[0].finish_reason) == (g[0].tokens, g[0].finish_reason)
        assert s[0].logprob == pytest.approx(g[0].logprob, abs=1e-5)


def test_top_k_samples_only_top_tokens_with_renormalised_frequencies():
    logits = torch.tensor([[1.0, 3.0, -1.0, 2.5, 0.0, 0.5]])
    config = GenerationConfig(strategy="sample", max_new_tokens=4, top_k=2, seed=0, num_return_sequences=4000)
    tokens, parents = make_search(config, 1).advance(logits)
    assert parents.tolist() == [0] * 4000
    counts = Counter(tokens.tolist())
    assert set(counts) == {1, 3}
    assert counts[1] / 4000 == pytest.approx(float(torch.softmax(torch.tensor([3.0, 2.5]), 0)[0]), abs=0.03)


def test_logits_filters():
    logits = torch.tensor([[1.0, 3.0, -1.0, 2.5], [0.0, 0.0, 5.0, 0.0]])
    assert torch.isfinite(apply_top_k(logits, 2)).tolist() == [[False, True, False, True], [True, True, True, True]]
    # probs row 0 ~ [.07, .56, .01, .35]: 0.6 needs the two most likely tokens, 0.5 only one
    assert torch.isfinite(apply_top_p(logits, 0.6))[0].tolist() == [False, True, False, True]
    assert torch.isfinite(apply_top_p(logits, 0.5)).tolist() == [[False, True, False, False],
                                                                  [False, False, True, False]]
    assert torch.equal(apply_top_p(logits, 1.0), logits) and torch.equal(apply_top_k(logits, 0), logits)


# ---- engine-style use: one search per request, rows of many searches in one model step ----------

def test_searches_sharing_one_batch_match_running_alone():
    model = ToyLM(eos_slope=0.3)
    requests = [  # (prompt, config, step at which the request joins the running batch)
        (0, GenerationConfig(max_new_tokens=8), 0),
        (1, GenerationConfig(strategy="beam", num_beams=3, num_return_sequences=2, max_new_tokens=8), 0),
        (4, GenerationConfig(strategy="sample", num_return_sequences=2, seed=3, max_new_tokens=8), 2),
        (5, GenerationConfig(strategy="beam", num_beams=2, max_new_tokens=6, min_new_tokens=2), 3),
    ]
    searches = [make_search(config, 1) for _, config, _ in requests]
    rows: list[list[int]] = []  # per-row history, concatenated over the running searches in order
    running: list[int] = []
    for step in range(100):
        for i, (prompt, _, join) in enumerate(requests):
            if join == step:
                running.append(i)
                rows.append([prompt])
        if not running:
            break
        logits = torch.stack([model.logits(torch.tensor([row]))[0] for row in rows])
        new_rows, offset = [], 0
        for i in running:
            n = searches[i].num_rows
            tokens, parents = searches[i].advance(logits[offset: offset + n])
            new_rows += [rows[offset + p] + [t] for t, p in zip(tokens.tolist(), parents.tolist(), strict=True)]
            offset += n
        rows, running = new_rows, [i for i in running if not searches[i].done]
    alone = [generate(model, [prompt], config)[0] for prompt, config, _ in requests]
    assert [search.results()[0] for search in searches] == alone


# ---- config ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    (dict(strategy="topk"), "strategy"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(min_new_tokens=5, max_new_tokens=4), "min_new_tokens"),
    (dict(num_beams=0), "num_beams"),
    (dict(strategy="beam", num_beams=2, num_return_sequences=3), "num_return_sequences"),
    (dict(num_return_sequences=2), "num_return_sequences"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=0.0), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(length_penalty=float("inf")), "length_penalty"),
    (dict(early_stopping="sometimes"), "early_stopping"),
    (dict(early_stopping=1), "early_stopping"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(seed=-1), "seed"),
    (dict(eos_token_id=-1), "eos_token_id"),
    (dict(stop_token_ids=(3, -2)), "stop_token_ids"),
    (dict(max_new_tokens=2.5), "max_new_tokens"),
])
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GenerationConfig(**kwargs)


def test_config_accepts_list_stop_ids_and_is_hashable():
    config = GenerationConfig(strategy="sample", num_return_sequences=3, stop_token_ids=[5, 4])
    assert config.stop_token_ids == (5, 4) and hash(config)
    assert isinstance(Hypothesis([], 0.0, 0.0, "eos"), Hypothesis)


@pytest.mark.parametrize("strategy", ["greedy", "beam", "sample"])
def test_banned_tokens_are_never_generated_and_a_forced_eos_ends_at_the_limit(strategy):
    """banned_token_ids (HF's single-token bad_words_ids) never appear; forced_eos makes the last allowed token
    EOS, so no row runs to the length limit (HF's forced_eos_token_id)."""
    model, prompts = ToyLM(vocab=8, eos_slope=0.0), list(range(8))
    plain = GenerationConfig(strategy=strategy, max_new_tokens=6, num_beams=3, seed=1, eos_token_id=EOS)
    common = Counter(t for hyps in generate(model, prompts, plain) for h in hyps for t in h.tokens).most_common(1)
    banned = common[0][0]
    config = GenerationConfig(strategy=strategy, max_new_tokens=6, num_beams=3, seed=1, eos_token_id=EOS,
                              banned_token_ids=(banned,), forced_eos=True)
    results = [h for hyps in generate(model, prompts, config) for h in hyps]
    assert all(banned not in h.tokens and len(h.tokens) <= 5 and h.finish_reason == "eos" for h in results)
    assert any(len(h.tokens) == 5 for h in results)  # some rows reached the forced EOS
