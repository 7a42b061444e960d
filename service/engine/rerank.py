"""Relevance scores of documents to a query: the pieces ``ModelWorker.rerank`` composes.

A classifier with a one-label head is a cross-encoder (ms-marco-MiniLM, bge-reranker): each (query, document) pair
is read as ``[CLS] query [SEP] document [SEP]`` (the tokenizer's pair template) and its logit goes through the
activation sentence-transformers' CrossEncoder applies (config.json's, else sigmoid: model.hf.sentence). Any other
classifier scores by the cosine of the query's and each document's embedding (the model's default pooling).

Truncation (TEI's ``truncate``): a pair loses tokens from the end of the document, never the query; a text alone
loses its own last tokens. Before encoding, a text to truncate is cut to the bytes its token limit can cover
(``Tokenizer.max_token_bytes``), so no document costs more to encode than one that fits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from model.tokenizer import Tokenizer
from service.engine.errors import InvalidRequest

CROSS_ENCODER, EMBEDDING_COSINE = "cross-encoder", "embedding-cosine"  # what scored a request (its scored_by)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sigmoid": torch.sigmoid, "identity": lambda logits: logits, "tanh": torch.tanh}  # model.hf.sentence's names
DEFAULT_ACTIVATION = "sigmoid"  # CrossEncoder's for one label, when config.json names none

Encoded = tuple[list[int], list[int]]  # (ids, segment ids)


def cut_to_bytes(text: str, max_bytes: int) -> str:
    """``text`` held to its first ``max_bytes`` UTF-8 bytes (never splitting a character)."""
    raw = text.encode("utf-8", "surrogatepass")
    return text if len(raw) <= max_bytes else raw[:max_bytes].decode("utf-8", "ignore")


def encode_scored(tokenizer: Tokenizer, query: str, document: str | None, max_tokens: int, truncate: bool,
                  field: str, query_field: str = "query") -> Encoded:
    """``(query, document)`` as a pair (or ``query`` alone when ``document`` is None) in at most ``max_tokens``
    tokens: over it, InvalidRequest naming ``field`` unless ``truncate``, which drops the document's (or the lone
    text's) last tokens; a query that leaves no room for the document is refused either way (naming ``query_field``).
    Blocking: run it on the tokenizer pool."""
    ids, segments = tokenizer.encode_pair(query, document)
    if len(ids) <= max_tokens:
        return ids, segments
    if not truncate:
        raise InvalidRequest(field, f"{len(ids)} tokens exceeds max_input_tokens={max_tokens} (send \"truncate\": "
                             "true to cut it to fit)")
    cut = tokenizer.encode(query if document is None else document)  # the tokens that may go, in order
    end = _end_of(ids, cut)
    over = len(ids) - max_tokens
    if end is None or over >= len(cut) + (document is None):  # a lone text keeps at least one token
        raise InvalidRequest(query_field if document is not None else field, f"{len(ids) - len(cut)} tokens without "
                             f"the document leave no room for it within max_input_tokens={max_tokens}")
    return ids[: end - over] + ids[end:], segments[: end - over] + segments[end:]


def encode_request(tokenizer: Tokenizer, queries: Sequence[str], documents: Sequence[str], max_tokens: int,
                   truncate: bool, pairs: bool, fields: tuple[str, str]) -> list[Encoded]:
    """The inputs that score ``documents`` against ``queries`` (one query for all, or one per document), each
    checked by :func:`encode_scored` (errors name ``fields``: the queries' and the documents' field, indexed): the
    (query, document) pairs, or (not ``pairs``) every query alone, then every document alone. Only documents are
    truncated. Blocking: run it on the tokenizer pool."""
    query_field = (lambda i: f"{fields[0]}[{i}]") if len(queries) > 1 else (lambda i: fields[0])
    if pairs:
        return [encode_scored(tokenizer, queries[i if len(queries) > 1 else 0], d, max_tokens, truncate,
                              f"{fields[1]}[{i}]", query_field(i)) for i, d in enumerate(documents)]
    return [*(encode_scored(tokenizer, q, None, max_tokens, False, query_field(i)) for i, q in enumerate(queries)),
            *(encode_scored(tokenizer, d, None, max_tokens, truncate, f"{fields[1]}[{i}]")
              for i, d in enumerate(documents))]


def _end_of(ids: list[int], run: list[int]) -> int | None:
    """Where the last occurrence of ``run`` in ``ids`` ends (the document is the pair's last text)."""
    for end in range(len(ids), len(run) - 1, -1):
        if ids[end - len(run): end] == run:
            return end
    return None


def check_counts(queries: int, documents: int, cap: int, field: str) -> None:
    """1 to ``cap`` documents (max_rerank_documents), for one query or one per document; else a 422 on ``field``."""
    if not documents:
        raise InvalidRequest(field, "expected a non-empty list")
    if documents > cap:
        raise InvalidRequest(field, f"{documents} documents exceeds max_rerank_documents={cap}")
    if queries not in (1, documents):
        raise InvalidRequest(field, f"{documents} documents for {queries} queries: send one query, or one per document")


def pair_scores(logits: list[list[float]], activation: str) -> list[float]:
    """Each pair's score: its one-label head's logit through ``activation``."""
    return ACTIVATIONS[activation](torch.tensor([row[0] for row in logits])).tolist()


def cosines(vectors: list[list[float]], queries: int) -> list[float]:
    """Per document, the cosine of its vector with its query's: ``vectors`` holds ``queries`` query vectors (one for
    all documents, or one per document), then one per document."""
    unit = torch.nn.functional.normalize(torch.tensor(vectors, dtype=torch.float64), dim=-1)
    query, documents = unit[:queries], unit[queries:]
    return (documents * query).sum(-1).tolist()
