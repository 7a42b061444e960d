"""Engine start-up, validation, classify/embed dynamic batching, attention maps and metrics."""

from __future__ import annotations

import asyncio
import dataclasses

import pydantic
import pytest
import torch
from prometheus_client import generate_latest

from model.build import build_model
from model.checkpoint import load_checkpoint, parameter_count, save_checkpoint
from model.lora import set_adapters
from model.lora_io import load_adapter
from service.api.schemas import GenerateRequest
from service.engine.errors import EngineFailure, InvalidRequest, NotFound
from service.engine.requests import GenerationRequest
from service.engine.types import EngineSettings
from tests.service.conftest import ADAPTERS, CLS, LABELS, LM, MT, ask, histogram_count, running_engine

METRICS = [
    "tserve_requests_total", "tserve_e2e_request_latency_seconds", "tserve_request_queue_time_seconds",
    "tserve_time_to_first_token_seconds", "tserve_inter_token_latency_seconds", "tserve_batch_size",
    "tserve_num_requests_running", "tserve_num_requests_waiting", "tserve_prompt_tokens_total",
    "tserve_generation_tokens_total", "tserve_adapter_loads_total", "tserve_adapter_unloads_total",
    "tserve_adapter_evictions_total", "tserve_resident_adapters", "tserve_model_load_seconds",
    "tserve_prefix_cache_queries_total", "tserve_prefix_cache_hits_total", "tserve_prefix_cache_bytes",
    "tserve_kv_cache_bytes",
]


def test_start_serves_good_checkpoints_and_reports_broken_ones(models_dir, adapters_dir, tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    for name in (LM, MT, CLS):
        (root / name).symlink_to(models_dir / name, target_is_directory=True)
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text("{not json")

    async def main():
        async with running_engine(root, adapters_dir, warmup=True) as engine:
            assert engine.ready
            assert set(engine.load_errors) == {"broken"} and "config.json" in engine.load_errors["broken"]
            infos = {m.name: m for m in engine.models()}
            assert sorted(infos) == [CLS, LM, MT]
            assert infos[CLS].labels == LABELS and infos[CLS].family == "classifier"
            assert infos[LM].max_new_tokens == 127 and infos[LM].max_input_tokens == 127
            assert infos[MT].max_input_tokens == 64 and infos[LM].adapters == [ADAPTERS[LM]]
            assert infos[LM].device == "cpu" and infos[LM].dtype == "float32" and infos[LM].parameters > 0
            with pytest.raises(NotFound, match="'broken' not found"):
                engine.get("broken")
            # warm-up went through the real path
            assert histogram_count(engine, "tserve_e2e_request_latency_seconds", {"model": LM, "endpoint": "generate"})

    asyncio.run(main())


def test_validation_names_field_and_limit(models_dir, adapters_dir):
    async def main():
        async with running_engine(models_dir, adapters_dir, max_input_tokens=8, max_inputs=3,
                                  max_new_tokens=20, max_beams=2) as engine:
            lm, cls = engine.get(LM), engine.get(CLS)
            def p(*inputs: str, **kw) -> GenerationRequest:
                return ask(*inputs, **{"max_new_tokens": 5, **kw})

            cases = [
                (lambda: cls.generate(p("a"), "r"), "model 'tiny-cls' is a classifier; generate needs"),
                (lambda: lm.classify(["a"], None, None, "r"),
                 "model 'tiny-lm' is a causal_lm; classify needs a classifier"),
                (lambda: lm.embed(["a"], "mean", "r"), "embed needs a classifier"),
                (lambda: lm.generate(p("a", "the quick brown fox jumps"), "r"),
                 r"inputs\[1\]: \d+ tokens exceeds max_input_tokens=8"),
                (lambda: lm.generate(p(*["a"] * 4), "r"), "4 inputs exceeds max_inputs=3"),
                (lambda: lm.generate(p("a", max_new_tokens=21), "r"), "max_new_tokens: 21 exceeds the limit 20"),
                (lambda: lm.generate(p("a", strategy="beam", num_beams=3), "r"), "num_beams: 3 exceeds max_beams=2"),
                (lambda: lm.generate(p("a", strategy="beam", num_beams=2, stop=["x"]), "r"), "stop:"),
                (lambda: lm.stream(p("a", strategy="sample", num_return_sequences=2), "r"),
                 "num_return_sequences: streaming"),
                (lambda: lm.stream(p("a", "b"), "r"), "inputs: streaming takes exactly one input"),
                (lambda: cls.classify(["a"], None, 0, "r"), "top_k: must be an integer >= 1"),
                (lambda: cls.classify([("a", "b", "c")], None, None, "r"), r"inputs\[0\]: expected a string or a pair"),
                (lambda: cls.embed(["a"], "sum", "r"), "pooling: must be one of"),
            ]
            for call, message in cases:
                with pytest.raises(InvalidRequest, match=message):
                    await call()
            # what the request schema refuses before the engine sees it (HTTP: the same 422 shape)
            for fields, field in [(dict(inputs=[]), "inputs"), (dict(inputs=["a"], strategy="nucleus"), "strategy"),
                                  (dict(inputs=["a"], temperature=0.0, strategy="sample"), "temperature"),
                                  (dict(inputs=["a"], max_new_tokens=0), "max_new_tokens")]:
                with pytest.raises(pydantic.ValidationError, match=field):
                    GenerateRequest(**fields)
            with pytest.raises(NotFound, match="adapter 'nope' not found for model 'tiny-cls'"):
                await cls.classify(["a"], "nope", None, "r")
            with pytest.raises(NotFound, match="model 'nope' not found"):
                engine.get("nope")
        async with running_engine(models_dir, None) as engine:  # input + max_new_tokens over the model's max_len
            with pytest.raises(InvalidRequest, match=r"inputs\[0\]: \d+ tokens \+ max_new_tokens=127 exceeds"):
                await engine.get(LM).generate(ask("hello world", max_new_tokens=127), "r")

    asyncio.run(main())


def test_classify_and_embed_batch_and_match_alone(models_dir, adapters_dir):
    inputs = ["hello world", ("the cat", "sat on the mat"), "gold", "a journey of a thousand miles", "x"]
    adapters = [None, ADAPTERS[CLS], None, ADAPTERS[CLS], None]

    async def main():
        async with running_engine(models_dir, adapters_dir, max_wait_ms=50) as engine:
            cls = engine.get(CLS)
            classified = asyncio.gather(*(cls.classify([x], a, 2, f"c{i}")
                                          for i, (x, a) in enumerate(zip(inputs, adapters, strict=True))))
            embedded = asyncio.gather(*(cls.embed([x], p, f"e{i}") for i, x in enumerate(["hello", "gold cat"])
                                        for p in ("cls", "mean")))
            together = await asyncio.gather(classified, embedded)
            many = await cls.classify(inputs[:3] * 20, None, None, "many")  # more inputs than max_batch_size
            assert histogram_count(engine, "tserve_batch_size", {"model": CLS}, le="1.0") < \
                histogram_count(engine, "tserve_batch_size", {"model": CLS})
            return together, many

    (classified, embedded), many = asyncio.run(main())
    ckpt = load_checkpoint(models_dir / CLS, device="cpu")
    load_adapter(ckpt.model, adapters_dir / CLS / ADAPTERS[CLS], "ref")
    with torch.inference_mode():
        for (out,), x, a in zip(classified, inputs, adapters, strict=True):
            ids, seg = ckpt.tokenizer.encode_pair(*((x, None) if isinstance(x, str) else x))
            set_adapters(ckpt.model, "ref" if a else None)
            probs = torch.softmax(ckpt.model(torch.tensor([ids]), torch.tensor([seg]))[0], -1).tolist()
            best = max(range(len(LABELS)), key=probs.__getitem__)
            assert out.label == LABELS[best] and out.score == pytest.approx(probs[best], abs=1e-5)
            assert len(out.probabilities) == 2 and list(out.probabilities.values()) == sorted(
                out.probabilities.values(), reverse=True)
        set_adapters(ckpt.model, None)
        cases = [(t, p) for t in ["hello", "gold cat"] for p in ("cls", "mean")]
        for (vector,), (text, pooling) in zip(embedded, cases, strict=True):
            ids, _ = ckpt.tokenizer.encode_pair(text)
            want = ckpt.model.embed_texts(torch.tensor([ids]), None, pooling)[0]
            assert vector == pytest.approx(want.tolist(), abs=1e-5)
    assert len(many) == 60 and len(many[0].probabilities) == len(LABELS)
    assert all(out.probabilities == pytest.approx(many[i % 3].probabilities) for i, out in enumerate(many))
    for i in (0, 2):  # no adapter in either call
        assert many[i].score == pytest.approx(classified[i][0].score, abs=1e-5)


def test_attention_maps_have_layer_head_query_key_shape(models_dir):
    async def main():
        async with running_engine(models_dir, None, max_new_tokens=10) as engine:
            return (await engine.get(CLS).attention("hello world", None, "a1"),
                    await engine.get(MT).attention("hello", "le chat", "a2"),
                    await engine.get(MT).attention("hello", None, "a3"),
                    await engine.get(LM).attention("hello", " world", "a4"))

    cls, mt, mt_greedy, lm = asyncio.run(main())

    def shape(maps):
        return (len(maps), len(maps[0]), len(maps[0][0]), len(maps[0][0][0]))

    s, t = len(cls.source_tokens), None
    assert set(cls.maps) == {"encoder_self"} and shape(cls.maps["encoder_self"]) == (2, 4, s, s)
    assert cls.target_tokens is None and cls.source_tokens[0] == "[CLS]"
    s, t = len(mt.source_tokens), len(mt.target_tokens)
    assert mt.target_tokens[0] == "<s>" and "".join(mt.target_tokens[1:]) == "le chat"
    assert shape(mt.maps["encoder_self"]) == (2, 4, s, s) and shape(mt.maps["decoder_self"]) == (2, 4, t, t)
    assert shape(mt.maps["cross"]) == (2, 4, t, s)
    assert sum(mt.maps["cross"][0][0][0]) == pytest.approx(1.0, abs=1e-4)
    assert 1 < len(mt_greedy.target_tokens) <= 11
    n = len(lm.source_tokens) + len(lm.target_tokens)
    assert set(lm.maps) == {"self"} and shape(lm.maps["self"]) == (2, 4, n, n) and lm.source_tokens[0] == "<s>"


def test_metrics_after_traffic(models_dir, adapters_dir):
    async def main():
        async with running_engine(models_dir, adapters_dir) as engine, running_engine(models_dir, None) as other:
            await asyncio.gather(engine.get(LM).generate(ask("hello", "the cat", max_new_tokens=5), "g"),
                                 engine.get(MT).generate(ask("hello", max_new_tokens=5,
                                                                                  adapter=ADAPTERS[MT]), "m"),
                                 engine.get(CLS).classify(["hello"], None, None, "c"))
            await engine.get(LM).unload_adapter(ADAPTERS[LM])
            engine.metrics.record_request(LM, "generate", None, 200)
            text = generate_latest(engine.metrics.registry).decode()
            other_text = generate_latest(other.metrics.registry).decode()
            return engine, text, other_text

    engine, text, other_text = asyncio.run(main())
    for name in METRICS:
        assert name in text, name
    assert 'tserve_requests_total{adapter="",endpoint="generate",model="tiny-lm",status="200"} 1.0' in text
    assert 'tserve_requests_total{' not in other_text  # one registry per engine
    value = engine.metrics.registry.get_sample_value
    assert value("tserve_generation_tokens_total", {"model": LM, "adapter": ""}) == 10
    assert value("tserve_generation_tokens_total", {"model": MT, "adapter": ADAPTERS[MT]}) > 0
    assert value("tserve_prompt_tokens_total", {"model": CLS, "adapter": ""}) > 0
    assert value("tserve_adapter_unloads_total", {"model": LM}) == 1
    assert value("tserve_time_to_first_token_seconds_count", {"model": LM}) == 1  # per request
    assert value("tserve_num_requests_running", {"model": LM}) == 0
    assert histogram_count(engine, "tserve_request_queue_time_seconds", {"model": CLS, "endpoint": "classify"}) == 1


def test_engine_settings_defaults_match_the_contract():
    s = EngineSettings()
    assert (s.max_batch_size, s.max_wait_ms, s.max_queue, s.max_new_tokens, s.request_timeout_s) == (32, 5.0, 256, 256,
                                                                                                     60.0)


def test_a_failing_classify_job_fails_alone(models_dir):
    def hook(ids):
        if "boom" in ids:
            raise RuntimeError("injected fault")

    async def main():
        async with running_engine(models_dir, None, max_wait_ms=50) as engine:
            cls = engine.get(CLS)
            cls.scheduler.fault_hook = hook
            return await asyncio.gather(cls.classify(["hello"], None, None, "ok"),
                                        cls.classify(["x"], None, None, "boom"),
                                        cls.embed(["gold"], "mean", "ok-2"), return_exceptions=True)

    ok, boom, ok2 = asyncio.run(main())
    assert isinstance(boom, EngineFailure) and boom.request_id == "boom" and "injected fault" in str(boom)
    assert ok[0].label in LABELS and len(ok2[0]) == 32


def test_quantize_setting_makes_the_named_model_int8_with_adapters(models_dir, adapters_dir):
    """quantize="none,<mt>=int8": only that model is int8; it generates what the offline int8 model does."""
    from model.decoding import GenerationConfig
    from model.generation import generate_seq2seq
    from model.quantize import Int8Linear, quantize_int8
    from tests.service.conftest import TEXTS

    async def main():
        async with running_engine(models_dir, adapters_dir, quantize=f"none,{MT}=int8") as engine:
            mt, lm = engine.get(MT), engine.get(LM)
            assert any(isinstance(m, Int8Linear) for m in mt.model.modules())
            assert not any(isinstance(m, Int8Linear) for m in lm.model.modules())
            base = await mt.generate(ask(TEXTS[0], max_new_tokens=8), "q-base")
            adapted = await mt.generate(ask(TEXTS[0], max_new_tokens=8, adapter=ADAPTERS[MT]), "q-a")
            return base[0].tokens, adapted[0].tokens

    base, adapted = asyncio.run(main())
    ckpt = load_checkpoint(models_dir / MT, device="cpu")
    quantize_int8(ckpt.model)
    load_adapter(ckpt.model, adapters_dir / MT / ADAPTERS[MT], "ref")
    src = [ckpt.src_tokenizer.encode(TEXTS[0], add_eos=True)]
    config = GenerationConfig(max_new_tokens=8, eos_token_id=ckpt.config.eos_id)
    assert base == generate_seq2seq(ckpt.model, src, config)[0][0].tokens
    assert adapted == generate_seq2seq(ckpt.model, src, config, adapters="ref")[0][0].tokens


def test_a_classifier_without_a_head_serves_embeddings_and_refuses_classify(models_dir, tmp_path):
    """num_labels 0 (a Hugging Face BertModel is one): warm-up and /embed work, classify is a clear 422."""
    source = load_checkpoint(models_dir / CLS, device="cpu")
    config = dataclasses.replace(source.config, num_labels=0)
    headless = build_model(config)
    headless.load_state_dict({k: v for k, v in source.model.state_dict().items() if not k.startswith("classifier.")})
    save_checkpoint(tmp_path / "models" / "embedder", headless, source.tokenizer)

    async def main():
        async with running_engine(tmp_path / "models", None, warmup=True) as engine:
            worker = engine.get("embedder")
            with pytest.raises(InvalidRequest, match="'embedder' has no classification head .*use /embed"):
                await worker.classify(["a"], None, None, "r")
            vectors = await worker.embed(["hello world", "a"], "max", "r")
            want = source.model.embed_texts(torch.tensor([source.tokenizer.encode_pair("a")[0]]), pooling="max")
            torch.testing.assert_close(torch.tensor(vectors[1]), want[0])

    asyncio.run(main())


def test_model_info_counts_the_adapters_parameters_apart(models_dir, adapters_dir):
    """GET /v1/models' parameters are the model's own, loaded adapters or not; adapter_parameters what they add."""
    own = parameter_count(load_checkpoint(models_dir / LM, device="cpu").model)

    async def main():
        async with running_engine(models_dir, adapters_dir) as engine:
            worker = engine.get(LM)
            with_adapter = worker.info
            await worker.unload_adapter(ADAPTERS[LM])
            return with_adapter, worker.info

    with_adapter, without = asyncio.run(main())
    assert with_adapter.adapters == [ADAPTERS[LM]] and without.adapters == []
    assert with_adapter.parameters == without.parameters == own
    assert with_adapter.adapter_parameters > 0 and without.adapter_parameters == 0


def test_a_lone_generation_request_starts_without_waiting_for_company(models_dir):
    """Continuous batching never holds a request back to fill a batch: with a collate wait of an hour, a lone
    generate (both families) still completes; the 120 s bound only turns a hang into a failure."""

    async def main():
        async with running_engine(models_dir, None, max_wait_ms=3_600_000) as engine:
            for name in (LM, MT):
                outputs = await asyncio.wait_for(engine.get(name).generate(ask("hello", max_new_tokens=3), name), 120)
                assert len(outputs) == 1 and 1 <= len(outputs[0].tokens) <= 3

    asyncio.run(main())


def test_a_generation_config_beside_our_checkpoint_sets_defaults_a_request_can_override(models_dir, tmp_path):
    """generation_config.json in our own checkpoint: its repetition_penalty and no_repeat_ngram_size apply to a
    request that leaves them unset (listed in generation_defaults), and a request's own values replace them."""
    import json
    import shutil

    from tests.service.conftest import assert_same, offline

    root = tmp_path / "models"
    shutil.copytree(models_dir / LM, root / LM)
    rules = {"repetition_penalty": 1.6, "no_repeat_ngram_size": 2}
    (root / LM / "generation_config.json").write_text(json.dumps(rules))

    async def main():
        async with running_engine(root, None) as engine:
            worker = engine.get(LM)
            assert worker.info.generation_defaults == rules | {"early_stopping": False}
            ruled = await worker.generate(ask("hello world", max_new_tokens=16), "ruled")
            own = await worker.generate(ask("hello world", max_new_tokens=16, repetition_penalty=1.0,
                                            no_repeat_ngram_size=0), "own")
            return ruled, own

    ruled, own = asyncio.run(main())
    assert_same(ruled, offline(models_dir / LM, ["hello world"], dict(max_new_tokens=16, **rules)))
    assert_same(own, offline(models_dir / LM, ["hello world"], dict(max_new_tokens=16)))
    assert ruled[0].tokens != own[0].tokens
