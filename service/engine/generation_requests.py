"""A model's generate requests made into generation jobs: how to decode (the request's fields, the model's
generation rules and defaults, this server's limits: ``generation_config``, the one conversion) and the checks of
every generation field against the model (placeholder protection, target prefixes, constraints, speculation,
vocabulary maps), all before anything is queued.
"""

from __future__ import annotations

from typing import Any

from model.checkpoint import Checkpoint
from model.constraints import CompiledConstraint, ConstraintError
from model.constraints import compile as compile_constraint
from model.decoding import ConfigError, GenerationConfig, Strategy
from model.hf.generation import GenerationRules
from model.placeholders import Protected, protect, sentinels_for
from model.speculative import SpeculativeConfig
from model.vocab_map import LanguageMaps, target_languages
from service.engine.errors import InvalidRequest
from service.engine.inputs import InputChecks
from service.engine.jobs import GenerationJob, StreamText
from service.engine.languages import language_plan
from service.engine.limits import check_cost
from service.engine.requests import DECODING_FIELDS, DEFAULTS, GenerationRequest
from service.engine.runners import GenerationRunner
from service.engine.types import EngineSettings

# Of the decoding fields, what the model's generation rules set for every request that leaves it unset.
RULED_FIELDS = ("repetition_penalty", "no_repeat_ngram_size")


class GenerationPlanner:
    """One generative model's generate requests into generation jobs (the adapter is the caller's to pin)."""

    def __init__(self, name: str, checkpoint: Checkpoint, settings: EngineSettings, runner: GenerationRunner,
                 inputs: InputChecks, max_new_tokens: int, draft_name: str | None,
                 default_speculative: SpeculativeConfig | None) -> None:
        self.name = name
        self.family = checkpoint.family
        self.checkpoint = checkpoint
        self.config = checkpoint.config
        self.settings = settings
        self.runner = runner
        self.inputs = inputs
        self.max_new_tokens = max_new_tokens
        self.draft_name = draft_name
        self.default_speculative = default_speculative
        if default_speculative is not None and default_speculative.method == "draft_model" and draft_name is None:
            raise ConfigError("speculative", f"model {name!r} defaults to draft_model drafting but has no draft "
                              "model (setting draft_model)")

    def capped_new_tokens(self, wanted: int) -> int:
        """``wanted`` new tokens within this model's cap (a default that a request did not ask for)."""
        return max(1, min(wanted, self.max_new_tokens))

    @property
    def rules(self) -> dict[str, Any]:
        """What the model's own generation config imposes on every search (an HF model's banned tokens, forced
        EOS, n-gram rule): GenerationConfig fields."""
        return (self.checkpoint.generation or GenerationRules()).imposed()

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """The model's own defaults for what a generate request leaves unset (an HF model's generation config:
        GenerationRequest fields), within this server's limits."""
        rules = self.checkpoint.generation or GenerationRules()
        defaults = dict(rules.defaults) | {name: getattr(rules, name) for name in RULED_FIELDS
                                           if getattr(rules, name) != getattr(GenerationRules, name)}
        if "max_new_tokens" in defaults:
            defaults["max_new_tokens"] = min(defaults["max_new_tokens"], self.max_new_tokens)
        if "num_beams" in defaults:
            defaults["num_beams"] = min(defaults["num_beams"], self.settings.max_beams)
        return defaults

    def generation_config(self, req: GenerationRequest, stream: bool = False) -> GenerationConfig:
        """The one conversion of a generate request into how to decode: the fields it sets, the model's
        defaults for those it leaves unset (else GenerationConfig's), checked against this server's limits and
        what the request may cost, with the model's EOS and its generation rules."""
        s = self.settings
        given = req.decoding.given()
        values = {name: getattr(DEFAULTS, name) for name in DECODING_FIELDS}
        values |= self.generation_defaults | given
        if "max_new_tokens" not in given and "max_new_tokens" not in self.generation_defaults:
            values["max_new_tokens"] = self.capped_new_tokens(DEFAULTS.max_new_tokens)
        if "min_new_tokens" not in given:  # the model's default (min_length) held to this request's length
            values["min_new_tokens"] = min(values["min_new_tokens"], values["max_new_tokens"])
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
        rules = self.rules
        for name in RULED_FIELDS:  # the request's own value over the model's rule
            value = values.pop(name)
            if name in given:
                rules[name] = value
        try:
            stops = tuple(dict.fromkeys(t for t in req.stop_token_ids if t != self.config.eos_id))
            return GenerationConfig(**values, eos_token_id=self.config.eos_id, stop_token_ids=stops, **rules)
        except ConfigError as exc:
            raise InvalidRequest(exc.field, exc.message) from None

    async def job(self, req: GenerationRequest, request_id: str, stream: bool) -> GenerationJob:
        """``req`` checked, encoded and made into a job (not yet queued; its adapter not yet pinned)."""
        self.inputs.count(req.inputs)
        config = self.generation_config(req, stream)
        tokenizer = self.checkpoint.prompt_tokenizer
        texts = [self.inputs.size(f"inputs[{i}]", text, tokenizer, self.inputs.max_input_tokens)
                 for i, text in enumerate(req.inputs)]
        protected = self._protected(req, texts)
        if protected is not None:
            texts = [p.text for p in protected]
        languages = language_plan(self.name, self.checkpoint, req.target_lang, req.source_lang, len(texts))
        prompts = []
        if req.prompt_ids is not None and len(req.prompt_ids) != len(texts):
            raise InvalidRequest("inputs", f"{len(texts)} inputs but {len(req.prompt_ids)} encoded prompts")
        encode = (lambda: languages.encode(self.checkpoint, texts)) if any(languages.sources) else (
            lambda: self.inputs.encode(texts))
        encoded = req.prompt_ids if req.prompt_ids is not None else await self.inputs.run(encode)
        for i, ids in enumerate(encoded):
            self.inputs.length(i, ids)
            if not ids:  # an imported tokenizer may add nothing to a text that encodes to nothing
                raise InvalidRequest(f"inputs[{i}]", "the text encodes to no tokens; generation needs at least one")
            if config.max_new_tokens > self.runner.room(len(ids)):
                raise InvalidRequest(f"inputs[{i}]", f"{len(ids)} tokens + max_new_tokens={config.max_new_tokens} "
                                     f"exceeds the model's max_len={self.config.max_len}")
            prompts.append(ids)
        forced = list(languages.forced)
        targets = await self._target_prefixes(req, config, forced)
        if protected is not None and req.target_prefix is not None:  # the prefix already holds some placeholders
            protected = [p.after(prefix) for p, prefix in zip(protected, req.target_prefix, strict=True)]
        constraint = await self._constraint(req)
        speculative = self._speculative(req, config, constrained=constraint is not None)
        stops = [s for s in req.stop if s]
        text_stream = None
        if stream:
            text_stream = StreamText.of(self.checkpoint.tokenizer, stops, protected[0] if protected else None,
                                        targets[0] if targets else [])
        return GenerationJob(request_id, self.settings.request_timeout_s, prompts, config, stops,
                             stream=text_stream, targets=targets,
                             speculative=speculative, constraint=constraint, protected=protected,
                             use_vmap=self._use_vmap(req, target_languages(forced, targets, len(prompts))),
                             forced=forced if languages.any_forced else None)

    def _use_vmap(self, req: GenerationRequest, languages: list[int | None]) -> bool:
        """Whether ``req``'s outputs keep to the model's vocabulary map: its ``use_vmap``, else whether there is one.
        With maps per target language (``languages``: each row's language token), ``use_vmap: true`` needs a map for
        every row's language; left unset, a row whose language has none uses the whole vocabulary."""
        vmap = self.runner.vocab_map
        if req.use_vmap and vmap is None:
            where = (" (vmap.txt, or vmaps/<code>.txt per target language, in its directory)"
                     if self.family == "seq2seq" else f": {self.family} models take none")
            raise InvalidRequest("use_vmap", f"model {self.name!r} has no vocabulary map{where}")
        if req.use_vmap and isinstance(vmap, LanguageMaps):
            missing = next((i for i, language in enumerate(languages) if not vmap.has(language)), None)
            if missing is not None:
                per_row = req.target_lang is not None and not isinstance(req.target_lang, str)
                code = req.target_lang[missing] if per_row else req.target_lang
                what = f"target language {code!r}" if code is not None else "an input without a target_lang"
                raise InvalidRequest(f"target_lang[{missing}]" if per_row else "target_lang",
                                     f"use_vmap: model {self.name!r} has no vocabulary map for {what} (maps: "
                                     f"{', '.join(sorted(vmap.codes.values()))})")
        return vmap is not None if req.use_vmap is None else req.use_vmap

    def _protected(self, req: GenerationRequest, texts: list[str]) -> list[Protected] | None:
        """Each input with its placeholders swapped for the sentinels the model's tokenizers have (model.placeholders;
        none: checked only), or None when placeholders are not protected (default: seq2seq only)."""
        if req.protect_placeholders and self.family != "seq2seq":
            raise InvalidRequest("protect_placeholders", f"seq2seq models only; {self.name} is {self.family}")
        if not (self.family == "seq2seq" if req.protect_placeholders is None else req.protect_placeholders):
            return None
        sentinels = sentinels_for(self.checkpoint.tokenizer, self.checkpoint.prompt_tokenizer)
        return [protect(text, sentinels) for text in texts]

    async def _constraint(self, req: GenerationRequest) -> CompiledConstraint | None:
        """``req.constraint`` checked against this model's vocabulary (compiled off the event loop)."""
        if req.constraint is None:
            return None
        constraint = req.constraint  # a translator's too: its grammar starts after a forced first token
        try:
            return await self.inputs.run(lambda: compile_constraint(constraint, self.checkpoint.tokenizer))
        except ConstraintError as exc:
            raise InvalidRequest(f"constraint.{constraint.kind}", str(exc)) from None
        except (ValueError, TypeError, RuntimeError) as exc:  # the library's own refusals
            raise InvalidRequest(f"constraint.{constraint.kind}", f"cannot be used: {exc}") from None

    def _speculative(self, req: GenerationRequest, config: GenerationConfig, constrained: bool
                     ) -> SpeculativeConfig | None:
        """How ``req`` drafts: its own "speculative" field, else the model's default where the request can
        speculate (one input, greedy or one sample, no constraint)."""
        eligible = (len(req.inputs) == 1 and config.strategy != Strategy.BEAM and config.num_return_sequences == 1
                    and not constrained)
        if req.speculative is None:
            return self.default_speculative if eligible else None
        if req.speculative == "off":
            return None
        if not eligible:
            raise InvalidRequest("speculative", "drafting needs one input and one sequence (greedy or sample) "
                                 f"without a constraint, got {len(req.inputs)} inputs, strategy "
                                 f"{config.strategy.value}, num_return_sequences {config.num_return_sequences}"
                                 f"{', a constraint' if constrained else ''}")
        if req.speculative.method == "draft_model" and self.draft_name is None:
            raise InvalidRequest("speculative.method", f"model {self.name!r} has no draft model (setting "
                                 "draft_model); use ngram")
        return req.speculative

    async def _target_prefixes(self, req: GenerationRequest, config: GenerationConfig, forced: list[int | None]
                               ) -> list[list[int]] | None:
        """The target tokens of ``req.target_prefix`` (seq2seq: one per input), checked against the model's length. A
        row's forced first token (``forced``, a target language's) starts its non-empty prefix, and is then no longer
        forced (its entry set to None in place)."""
        if req.target_prefix is None:
            return None
        if self.family != "seq2seq":
            raise InvalidRequest("target_prefix", f"continues a translation: model {self.name!r} is a {self.family} "
                                 "model, whose outputs already continue their input")
        if len(req.target_prefix) != len(req.inputs):
            raise InvalidRequest("target_prefix", f"needs one entry per input ({len(req.inputs)}), got "
                                 f"{len(req.target_prefix)}")
        tokenizer, room = self.checkpoint.tokenizer, self.config.max_len - 1 - config.max_new_tokens
        texts = [self.inputs.size(f"target_prefix[{i}]", self.inputs.text(i, t), tokenizer, max(room, 1), "max_len")
                 for i, t in enumerate(req.target_prefix)]
        targets = await self.inputs.run(lambda: [tokenizer.encode(t) for t in texts])
        for i, ids in enumerate(targets):
            if ids and forced[i] is not None:
                ids = targets[i] = [forced[i], *ids]
                forced[i] = None
            if len(ids) > room:
                raise InvalidRequest(f"target_prefix[{i}]", f"{len(ids)} tokens + max_new_tokens="
                                     f"{config.max_new_tokens} exceeds the model's max_len={self.config.max_len} - 1")
        return targets
