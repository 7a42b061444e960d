"""What one request may cost, bounded before it runs: the token entries it can generate or score.

A generate or completions request costs ``rows x new tokens x (1 + log-probability alternatives)`` token entries,
where rows are its inputs times the sequences each one searches or returns (beams or samples): that product bounds
its decoding work and the size of its answer. A 21 KB request asking for 64 inputs x 8 beams x 256 tokens x 21
log-probabilities used to return 178 MB; over ``max_tokens_per_request`` it is now a 422 naming the product.
Echo (scoring a prompt) costs its prompt tokens x (1 + alternatives) the same way.
"""

from __future__ import annotations

import math

from service.engine.errors import InvalidRequest

SETTING = "max_tokens_per_request"


def check_cost(limit: int, factors: dict[str, int], alternatives: int | None) -> None:
    """Raise InvalidRequest (422, naming the product) when a request's token entries, the product of ``factors``
    (named as the request names them: inputs, num_beams, max_new_tokens...) times 1 + ``alternatives``
    log-probabilities, exceed ``limit``."""
    cost = math.prod(factors.values()) * (1 + (alternatives or 0))
    if cost > limit:
        product = " x ".join(f"{name} {value:,}" for name, value in factors.items())
        extra = f" x (1 + logprobs {alternatives})" if alternatives else ""
        raise InvalidRequest(None, f"{product}{extra} = {cost:,} token entries, over this server's limit of "
                             f"{limit:,} per request (setting {SETTING}): ask for fewer inputs, sequences, tokens or "
                             "log-probabilities, or split the request")
