"""A model worker's generate requests made into generation jobs: how to decode (the request's fields, the model's
generation rules and defaults, this server's limits: ``generation_config``, the one conversion) and the checks of
every generation field against the model (placeholder protection, target prefixes, constraints, speculation,
vocabulary maps), all before anything is queued.

``GenerationRequests`` is that side of service/worker.py's ModelWorker, which inherits it: it reads the worker's
checkpoint, runner and settings, and uses its encoding and checking helpers (``_tokenize``, ``_check_size``,
``_check_length``, ``_check_count``, ``_require``, ``_acquire``).
"""

from __future__ import annotations

from typing import Any

from model.checkpoint import Checkpoint
from model.config import TransformerConfig
from model.constraints import CompiledConstraint, Constraint, ConstraintError
from model.constraints import compile as compile_constraint
from model.decoding import ConfigError, GenerationConfig, Strategy
from model.hf.generation import GenerationRules
from model.placeholders import Protected, protect, sentinels_for
from model.speculative import SpeculativeConfig
from service.errors import InvalidRequest
from service.jobs import GenerationJob, StreamText, continuation
from service.limits import check_cost
from service.runners import GenerationRunner
from service.schemas import DEFAULT_NEW_TOKENS, GenerateRequest
from service.types import EngineSettings

# The GenerateRequest fields that are GenerationConfig fields too.
DECODING_FIELDS = ("strategy", "max_new_tokens", "min_new_tokens", "num_beams", "length_penalty", "early_stopping",
                   "num_return_sequences", "temperature", "top_k", "top_p", "seed", "logprobs", "repetition_penalty",
                   "no_repeat_ngram_size")
# Of those, what the model's generation rules set for every request that leaves it unset.
RULED_FIELDS = ("repetition_penalty", "no_repeat_ngram_size")
GENERATIVE = ("causal_lm", "seq2seq")


class GenerationRequests:
    """Generate requests into generation jobs; mixed into ModelWorker (see the module docstring)."""

    name: str
    family: str
    checkpoint: Checkpoint
    config: TransformerConfig
    settings: EngineSettings
    runner: GenerationRunner | None
    max_input_tokens: int
    max_new_tokens: int
    draft_name: str | None
    _default_speculative: SpeculativeConfig | None

    @property
    def _rules(self) -> dict[str, Any]:
        """What the model's own generation config imposes on every search (an HF model's banned tokens, forced
        EOS, n-gram rule): GenerationConfig fields."""
        return (self.checkpoint.generation or GenerationRules()).imposed()

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """The model's own defaults for what a generate request leaves unset (an HF model's generation config:
        GenerateRequest fields), within this server's limits."""
        rules = self.checkpoint.generation or GenerationRules()
        defaults = dict(rules.defaults) | {name: getattr(rules, name) for name in RULED_FIELDS
                                           if getattr(rules, name) != getattr(GenerationRules, name)}
        if "max_new_tokens" in defaults:
            defaults["max_new_tokens"] = min(defaults["max_new_tokens"], self.max_new_tokens)
        if "num_beams" in defaults:
            defaults["num_beams"] = min(defaults["num_beams"], self.settings.max_beams)
        return defaults

    def generation_config(self, req: GenerateRequest, stream: bool = False) -> GenerationConfig:
        """The one conversion of a generate request into how to decode: the fields it sets, the model's
        defaults for those it leaves unset (else the schema's), checked against this server's limits, with the
        model's EOS and its generation rules."""
        s = self.settings
        values = {name: getattr(req, name) for name in DECODING_FIELDS}
        values |= {k: v for k, v in self.generation_defaults.items()
                   if k not in req.model_fields_set or values[k] is None}
        if values["max_new_tokens"] is None:
            values["max_new_tokens"] = max(1, min(DEFAULT_NEW_TOKENS, self.max_new_tokens))
        beam = values["strategy"] == Strategy.BEAM
        limits = (("max_new_tokens", self.max_new_tokens, f"the limit {self.max_new_tokens} (max_new_tokens="
                   f"{s.max_new_tokens}, model max_len={self.config.max_len})"),
                  ("num_beams", s.max_beams if beam else None, f"max_beams={s.max_beams}"),
                  ("num_return_sequences", s.max_return_sequences, f"max_return_sequences={s.max_return_sequences}"))
        for name, cap, limit in limits:
            if cap is not None and values[name] > cap:
                raise InvalidRequest(name, f"{values[name]} exceeds {limit}")
        if beam and any(req.stop):
            raise InvalidRequest("stop", "stop strings are not supported with strategy 'beam'")
        if stream and not beam and values["num_return_sequences"] != 1:
            raise InvalidRequest("num_return_sequences",
                                 f"streaming returns one sequence, got {values['num_return_sequences']}")
        if not beam:
            values["num_beams"] = 1
        width = ("num_beams", values["num_beams"]) if beam else ("num_return_sequences", values["num_return_sequences"])
        check_cost(s.max_tokens_per_request, dict([("inputs", len(req.inputs)), width,
                                                   ("max_new_tokens", values["max_new_tokens"])]), values["logprobs"])
        rules = self._rules
        for name in RULED_FIELDS:  # the request's own value over the model's rule
            value = values.pop(name)
            if name in req.model_fields_set:
                rules[name] = value
        try:
            return GenerationConfig(**values, eos_token_id=self.config.eos_id, **rules)
        except ConfigError as exc:
            raise InvalidRequest(exc.field, exc.message) from None

    async def _generation_job(self, req: GenerateRequest, request_id: str, stream: bool) -> GenerationJob:
        self._require("generate", GENERATIVE)
        self._check_count(req.inputs)
        config = self.generation_config(req, stream)
        tokenizer = self.checkpoint.prompt_tokenizer
        texts = [self._check_size(f"inputs[{i}]", text, tokenizer, self.max_input_tokens)
                 for i, text in enumerate(req.inputs)]
        protected = self._protected(req, texts)
        if protected is not None:
            texts = [p.text for p in protected]
        prompts = []
        for i, ids in enumerate(await self._tokenize(lambda: self.checkpoint.encode_prompts(texts))):
            self._check_length(i, ids)
            if not ids:  # an imported tokenizer may add nothing to a text that encodes to nothing
                raise InvalidRequest(f"inputs[{i}]", "the text encodes to no tokens; generation needs at least one")
            if config.max_new_tokens > self.runner.room(len(ids)):
                raise InvalidRequest(f"inputs[{i}]", f"{len(ids)} tokens + max_new_tokens={config.max_new_tokens} "
                                     f"exceeds the model's max_len={self.config.max_len}")
            prompts.append(ids)
        targets = await self._target_prefixes(req, config)
        constraint = await self._constraint(req)
        speculative = self._speculative(req, config, constrained=constraint is not None)
        stops = [s for s in req.stop if s]
        text_stream = None
        if stream:
            text_stream = StreamText(continuation(self.checkpoint.tokenizer.decode, targets[0] if targets else []),
                                     stops, protected[0] if protected else None)
        return GenerationJob(request_id, self.settings.request_timeout_s, prompts, config, stops,
                             adapter=self._acquire(req.adapter), stream=text_stream, targets=targets,
                             speculative=speculative, constraint=constraint, protected=protected,
                             use_vmap=self._use_vmap(req))

    def _use_vmap(self, req: GenerateRequest) -> bool:
        """Whether ``req``'s outputs keep to the model's vocabulary map: its ``use_vmap``, else whether there is one."""
        has_map = self.runner.vocab_map is not None
        if req.use_vmap and not has_map:
            where = " (vmap.txt in its directory)" if self.family == "seq2seq" else f": {self.family} models take none"
            raise InvalidRequest("use_vmap", f"model {self.name!r} has no vocabulary map{where}")
        return has_map if req.use_vmap is None else req.use_vmap

    def _protected(self, req: GenerateRequest, texts: list[str]) -> list[Protected] | None:
        """Each input with its placeholders swapped for the sentinels the model's tokenizers have (model.placeholders;
        none: checked only), or None when placeholders are not protected (default: seq2seq only)."""
        if req.protect_placeholders and self.family != "seq2seq":
            raise InvalidRequest("protect_placeholders", f"seq2seq models only; {self.name} is {self.family}")
        if not (self.family == "seq2seq" if req.protect_placeholders is None else req.protect_placeholders):
            return None
        sentinels = sentinels_for(self.checkpoint.tokenizer, self.checkpoint.prompt_tokenizer)
        return [protect(text, sentinels) for text in texts]

    async def _constraint(self, req: GenerateRequest) -> CompiledConstraint | None:
        """``req.constraint`` checked against this model's vocabulary (compiled off the event loop)."""
        if req.constraint is None:
            return None
        if self.family != "causal_lm":
            raise InvalidRequest("constraint", f"constrained decoding is for causal_lm models; {self.name!r} is a "
                                 f"{self.family} model")
        constraint = Constraint(req.constraint.kind, getattr(req.constraint, req.constraint.kind))
        try:
            return await self._tokenize(lambda: compile_constraint(constraint, self.checkpoint.tokenizer))
        except ConstraintError as exc:
            raise InvalidRequest(f"constraint.{constraint.kind}", str(exc)) from None
        except (ValueError, TypeError, RuntimeError) as exc:  # the library's own refusals
            raise InvalidRequest(f"constraint.{constraint.kind}", f"cannot be used: {exc}") from None

    def _speculative(self, req: GenerateRequest, config: GenerationConfig, constrained: bool
                     ) -> SpeculativeConfig | None:
        """How ``req`` drafts: its own "speculative" field, else the model's default where the request can
        speculate (one input, greedy or one sample, no constraint)."""
        eligible = (len(req.inputs) == 1 and config.strategy != Strategy.BEAM and config.num_return_sequences == 1
                    and not constrained)
        if req.speculative is None:
            return self._default_speculative if eligible else None
        if req.speculative.method == "none":
            return None
        if not eligible:
            raise InvalidRequest("speculative", "drafting needs one input and one sequence (greedy or sample) "
                                 f"without a constraint, got {len(req.inputs)} inputs, strategy "
                                 f"{config.strategy.value}, num_return_sequences {config.num_return_sequences}"
                                 f"{', a constraint' if constrained else ''}")
        if req.speculative.method == "draft_model" and self.draft_name is None:
            raise InvalidRequest("speculative.method", f"model {self.name!r} has no draft model (setting "
                                 "draft_model); use ngram")
        return SpeculativeConfig(req.speculative.method, req.speculative.num_tokens)

    async def _target_prefixes(self, req: GenerateRequest, config: GenerationConfig) -> list[list[int]] | None:
        """The target tokens of ``req.target_prefix`` (seq2seq: one per input), checked against the model's length."""
        if req.target_prefix is None:
            return None
        if self.family != "seq2seq":
            raise InvalidRequest("target_prefix", f"continues a translation: model {self.name!r} is a {self.family} "
                                 "model, whose outputs already continue their input")
        if len(req.target_prefix) != len(req.inputs):
            raise InvalidRequest("target_prefix", f"needs one entry per input ({len(req.inputs)}), got "
                                 f"{len(req.target_prefix)}")
        tokenizer, room = self.checkpoint.tokenizer, self.config.max_len - 1 - config.max_new_tokens
        texts = [self._check_size(f"target_prefix[{i}]", self._text(i, t), tokenizer, max(room, 1), "max_len")
                 for i, t in enumerate(req.target_prefix)]
        targets = await self._tokenize(lambda: [tokenizer.encode(t) for t in texts])
        for i, ids in enumerate(targets):
            if len(ids) > room:
                raise InvalidRequest(f"target_prefix[{i}]", f"{len(ids)} tokens + max_new_tokens="
                                     f"{config.max_new_tokens} exceeds the model's max_len={self.config.max_len} - 1")
        return targets

    # ---- attention: prepared here, run on the worker thread (service.attention) ----------------------------
