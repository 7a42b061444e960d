"""Logits processing for the searches of model.decoding: pure functions over (rows, V) tensors."""

from __future__ import annotations

import torch

from model import native
from model.generation_config import GenerationConfig

NEG_INF = float("-inf")


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the vocabulary, in float32 whatever the logits' dtype."""
    return torch.log_softmax(logits.float(), dim=-1)


def greedy_choice(logits: torch.Tensor, step: int, config: GenerationConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens (rows,) under the bans, and their log-probs (rows,) in the unbanned distribution.

    float32 CPU logits go through one C++ pass per row (model/kernels/greedy_pick.cpp) where torch makes
    three and two (rows, V) tensors; the first maximal column wins either way, as ``argmax`` does.
    """
    if forces_eos(step, config):
        tokens = torch.full((logits.size(0),), config.eos_token_id, dtype=torch.long, device=logits.device)
        return tokens, log_probs(logits).select(1, config.eos_token_id)
    kernels = native.kernels()
    if kernels is not None and logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.stride(1) == 1:
        return kernels.greedy_pick(logits, list(banned_ids(step, config)))
    # max(dim) gives the first maximal index, as argmax does, and is 2-3x faster on CPU.
    chosen, tokens = mask_tokens(log_probs(logits), banned_ids(step, config), inplace=True).max(dim=-1)
    return tokens, chosen


def forces_eos(step: int, config: GenerationConfig) -> bool:
    """Whether step ``step`` may only produce EOS (``forced_eos`` at the last allowed step)."""
    return config.forced_eos and step == config.max_new_tokens - 1


def banned_ids(step: int, config: GenerationConfig) -> tuple[int, ...]:
    """Tokens step ``step`` may not produce: the banned ones, and EOS/stop tokens before ``min_new_tokens``."""
    return config.banned_token_ids + (config.finish_token_ids if step < config.min_new_tokens else ())


def mask_tokens(scores: torch.Tensor, token_ids: tuple[int, ...], inplace: bool = False) -> torch.Tensor:
    """`scores` (rows, V) with the columns `token_ids` set to -inf: a copy, or `scores` itself if `inplace`."""
    if not token_ids:
        return scores
    scores = scores if inplace else scores.clone()
    if len(token_ids) == 1:  # a column fill: no index tensor built (every step of a min-length search)
        scores.select(1, token_ids[0]).fill_(NEG_INF)
    else:
        scores[:, list(token_ids)] = NEG_INF
    return scores


def mask_banned(scores: torch.Tensor, step: int, config: GenerationConfig, inplace: bool = False) -> torch.Tensor:
    """``scores`` (log-probs) without what step ``step`` may not produce (``banned_ids``); at a forced EOS,
    only EOS, scored 0 as Hugging Face's ForcedEOSTokenLogitsProcessor does."""
    if forces_eos(step, config):
        scores = scores if inplace else scores.clone()
        return scores.fill_(NEG_INF).index_fill_(1, torch.tensor([config.eos_token_id], device=scores.device), 0.0)
    return mask_tokens(scores, banned_ids(step, config), inplace)


def top_k(scores: torch.Tensor, k: int, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores.topk(k, dim=1)`` (values, indices; best first) of a (rows, N) tensor, faster for large N.

    torch's CPU topk copies and partially sorts every row. Here a row is cut into chunks of ``chunk``
    columns and only the ``k`` chunks with the largest maxima are searched: every one of the k best
    values lies in a chunk whose maximum is at least the k-th best, and at most k chunks hold them.
    Equal values may come back in another order than topk's (which does not promise one either).
    """
    rows, n = scores.shape
    if n < 32 * k * chunk:  # few chunks: the plain topk is as fast
        return scores.topk(k, dim=1)
    full = n - n % chunk
    chunks = scores[:, :full].view(rows, -1, chunk).amax(dim=2).topk(k, dim=1).indices  # (rows, k)
    columns = (chunks[:, :, None] * chunk + torch.arange(chunk, device=scores.device)).view(rows, -1)
    if full < n:  # the last, partial chunk is always searched
        columns = torch.cat([columns, torch.arange(full, n, device=scores.device).expand(rows, -1)], dim=1)
    values, pick = scores.gather(1, columns).topk(k, dim=1)
    return values, columns.gather(1, pick)


def fused_beam_top_k(logits: torch.Tensor, scores: torch.Tensor, k: int, banned: tuple[int, ...]
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per sentence, the best ``k`` of log_softmax(logits) + its beam scores outside ``banned``: logits (S * W, V),
    scores (S, W) -> (values, ids (S, k): row-in-sentence * V + column), best first, equal values in id order.

    One C++ pass per row (model/kernels/beam_topk.cpp) where it applies (float32 CPU logits, unit stride along V):
    no (rows, V) tensor of log-probs is made. None where it does not: torch's log_softmax, the bans, the add and
    ``top_k`` give the same candidates (equal values aside) and the same values to float rounding.
    """
    kernels = native.kernels()
    if kernels is None or logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.stride(1) != 1:
        return None
    return kernels.beam_topk(logits, scores.flatten().float(), scores.size(1), k, list(banned))


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k highest logits per row (ties with the k-th survive); k = 0 keeps all."""
    if k <= 0 or k >= logits.size(-1):
        return logits
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, NEG_INF)


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (at least one)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # 0 for the most likely token
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, NEG_INF)


def sampling_logits(logits: torch.Tensor, step: int, config: GenerationConfig) -> torch.Tensor:
    """Bans (and a forced EOS), temperature, top-k and top-p, in that order, in float32."""
    scores = mask_banned(logits.float(), step, config) / config.temperature
    return apply_top_p(apply_top_k(scores, config.top_k), config.top_p)


def gumbel_argmax(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Sample one token per row from softmax(logits) given uniforms in [0, 1) of the same shape."""
    return (logits - torch.log(-torch.log(uniforms))).max(dim=-1).indices  # first maximum, as argmax


def repeated_ngram_bans(sequences: list[list[int]], n: int) -> list[list[int]]:
    """Per sequence, the tokens that would complete an n-gram it already holds (HF's no_repeat_ngram_size)."""
    bans = []
    for seq in sequences:
        if len(seq) + 1 < n:
            bans.append([])
            continue
        tail = tuple(seq[len(seq) - n + 1:]) if n > 1 else ()
        bans.append([seq[i + n - 1] for i in range(len(seq) - n + 1) if tuple(seq[i: i + n - 1]) == tail])
    return bans


def penalize_repeats(scores: torch.Tensor, sequences: list[list[int]], penalty: float) -> torch.Tensor:
    """``scores`` (rows, V), in place, with every token of a row's sequence made less likely as Hugging Face's
    repetition_penalty does it: a positive score divided by ``penalty``, a negative one multiplied by it."""
    rows = [r for r, seq in enumerate(sequences) for _ in set(seq)]
    if rows:
        held = torch.zeros_like(scores, dtype=torch.bool)
        held[rows, [t for seq in sequences for t in set(seq)]] = True
        penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
        scores.copy_(torch.where(held, penalized, scores))
    return scores


def mask_repeats(scores: torch.Tensor, sequences: list[list[int]], n: int) -> torch.Tensor:
    """``scores`` (rows, V), in place, with -inf where a row's next token would repeat one of its n-grams."""
    bans = repeated_ngram_bans(sequences, n)
    rows = [r for r, banned in enumerate(bans) for _ in banned]
    if rows:
        scores[rows, [t for banned in bans for t in banned]] = NEG_INF
    return scores
