"""Tiny checkpoints and LoRA adapters trained by the project's own training code on tiny data written here.

``build_models(root)`` writes ``root/models/{tiny-lm, tiny-mt, tiny-cls}/`` with ``train`` (the
``python -m training train ...`` command, called in-process) and ``make_adapter`` trains an adapter
with ``lora``. Each family gets its own tiny task, and each adapter seed its own, very different
task (an invented language for the LM and the translator, rotated labels for the classifier), so
that an adapter really specialises: ``check_adapter_changes_outputs`` asserts that it changes
greedy outputs, so the hot-swap and mixed-adapter tests cannot silently become vacuous.

Sizes: d_model 32, 2 layers, 4 heads, vocab 300 (the BPE minimum is 263); a few dozen steps
without intermediate validation (the last step validates once, which writes the checkpoint).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import random
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from model.checkpoint import load_checkpoint
from model.decoding import GenerationConfig
from model.generation import generate_causal, generate_seq2seq
from model.lora import set_adapters
from model.lora_io import CONFIG_FILE, WEIGHTS_FILE, load_adapter
from training.cli import build_parser

LM, MT, CLS = "tiny-lm", "tiny-mt", "tiny-cls"
FAMILIES = {LM: "causal_lm", MT: "seq2seq", CLS: "classifier"}
ADAPTERS = {LM: "lm-a", MT: "mt-a", CLS: "cls-a"}
ADAPTER_SEED = 1  # the seed of the adapters in ``adapters_dir``
LABELS = ["negative", "neutral", "positive"]

# Flags shared by every run: tiny sizes, one validation at the last step (which writes the checkpoint).
SIZES = ["--d-model", "32", "--heads", "4", "--ffn", "64", "--layers", "2", "--vocab-size", "300",
         "--dropout", "0"]  # fmt: skip
LOOP = ["--device", "cpu", "--eval-every", "100000", "--save-every", "100000", "--valid-examples", "8", "--quiet"]
# The LM's 128 positions let tests generate 120 tokens; the translator's 64 bound its sources.
MAX_LEN = {LM: "128", MT: "64", CLS: "128"}
BASE_STEPS = {LM: 60, MT: 80, CLS: 40}
BASE_LOOP = ["--batch-tokens", "1024", "--lr", "1e-2", "--warmup", "10"]
# Adapters: a high learning rate on very different data, so that they move greedy outputs for sure.
ADAPTER_LOOP = ["--rank", "4", "--alpha", "8", "--targets", "q_proj,k_proj,v_proj,out_proj,fc1,fc2",
                "--batch-tokens", "1024", "--lr", "2e-2", "--warmup", "5", "--max-steps", "30"]  # fmt: skip

# ---- tiny data ------------------------------------------------------------------------------------

VERBS = {"delete": "borrar", "open": "abrir", "close": "cerrar", "copy": "copiar", "move": "mover", "save": "guardar",
         "print": "imprimir", "rename": "renombrar"}  # fmt: skip
OBJECTS = {"file": "archivo", "folder": "carpeta", "window": "ventana", "list": "lista", "image": "imagen",
           "table": "tabla"}  # fmt: skip
SENTIMENT = {
    "positive": ["i love this", "what a great day", "this is wonderful", "the food was excellent", "we are very happy",
                 "a brilliant and fun film", "she enjoyed every minute", "best gift ever"],
    "negative": ["i hate this", "what a terrible day", "this is awful", "the food was disgusting", "we are very sad",
                 "a boring and ugly film", "he regretted every minute", "worst gift ever"],
    "neutral": ["the box is on the table", "it is a tuesday", "this is a chair", "the train leaves at noon",
                "we are in the kitchen", "a film about a city", "she reads every morning", "the gift is blue"],
}  # fmt: skip
STORY = """the quick brown fox jumps over the lazy dog. a journey of a thousand miles begins with a single step.
to be or not to be, that is the question. all that glitters is not gold. the cat sat on the mat and the dog
sat on the log. hello world, hello there, hello again. the sun rises in the east and sets in the west. a bird
in the hand is worth two in the bush. the early bird catches the worm. numbers 0 1 2 3 4 5 6 7 8 9 count the
days. the old man and the sea went to the market, and the market was full of fish and bread and apples.
"""
# Texts the HTTP tests send (classify, embed, attention).
TEXTS = ["the quick brown fox jumps over the lazy dog", "i love this", "the box is on the table",
         "what a terrible day", "hello world, hello there", "numbers 0 1 2 3"]  # fmt: skip
# Prompts the HTTP tests generate from.
PROMPTS = ["the quick brown", "hello world", "to be or", "all that", "le chat", "numbers 0 1", "def main", "a journey"]

# A chat template for our own LM, which has none (the setting chat_template gives it one): "</s>" is its EOS, a
# control token the template writes.
LM_CHAT_TEMPLATE = ("<s>{% for m in messages %}{{ m.role }}: {{ m.content }}</s>\n{% endfor %}"
                    "{% if add_generation_prompt %}assistant: {% endif %}")


def lm_chat_template(directory: Path) -> str:
    """The setting chat_template that gives LM the template LM_CHAT_TEMPLATE (written into ``directory``)."""
    path = directory / "lm_chat.jinja"
    path.write_text(LM_CHAT_TEMPLATE)
    return f"{LM}={path}"


def write_translation(path: Path, n: int, seed: int, variant: int | None = None) -> Path:
    """``n`` commands like "delete file 7" -> "borrar archivo 7".

    An adapter's ``variant`` answers in another dialect: the object first and the words shuffled
    (a different shuffle for each variant).
    """
    rng, words = random.Random(seed), {**VERBS, **OBJECTS}
    if variant is not None:
        shuffle = random.Random(variant)
        verbs, objects = list(VERBS.values()), list(OBJECTS.values())
        shuffle.shuffle(verbs)
        shuffle.shuffle(objects)
        words = {**dict(zip(VERBS, verbs, strict=True)), **dict(zip(OBJECTS, objects, strict=True))}
    lines = []
    for _ in range(n):
        verb, obj, number = rng.choice(list(VERBS)), rng.choice(list(OBJECTS)), rng.randint(0, 99)
        target = (f"{words[verb]} {words[obj]} {number}" if variant is None
                  else f"{words[obj]} {words[verb]} {number}")
        lines.append(f"{verb} {obj} {number}\t{target}\n")
    path.write_text("".join(lines), encoding="utf-8")
    return path


# Placeholders of the translator trained on protected pairs (train_placeholder_translator): the ones its data has.
PLACEHOLDERS_SEEN = ["%s", "%d", "{0}", "{name}", "$HOME", "--force", "<b>", "%(path)s"]


def write_placeholder_pairs(path: Path, n: int, seed: int) -> Path:
    """``n`` commands with one or two placeholders: "delete file %s" -> "borrar archivo %s"."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        verb, obj = rng.choice(list(VERBS)), rng.choice(list(OBJECTS))
        marks = " ".join(rng.sample(PLACEHOLDERS_SEEN, rng.randint(1, 2)))
        lines.append(f"{verb} {obj} {marks}\t{VERBS[verb]} {OBJECTS[obj]} {marks}\n")
    path.write_text("".join(lines), encoding="utf-8")
    return path


def write_labels(path: Path, seed: int, shift: int = 0) -> Path:
    """Sentiment texts with their label (shifted ``shift`` places along LABELS: an adapter's task)."""
    rng = random.Random(seed)
    rows = [(text, LABELS[(LABELS.index(label) + shift) % len(LABELS)])
            for label, texts in SENTIMENT.items() for text in texts]
    rng.shuffle(rows)
    path.write_text("".join(json.dumps({"text": t, "label": lab}) + "\n" for t, lab in rows), encoding="utf-8")
    return path


def write_text(path: Path, variant: int | None = None) -> Path:
    """The story; an adapter's ``variant``: one line of ten of its words (chosen by the variant), repeated."""
    if variant is None:
        path.write_text(STORY, encoding="utf-8")
        return path
    words = sorted(set(STORY.replace(".", " ").replace(",", " ").split()))
    line = " ".join(random.Random(variant).sample(words, 10))
    path.write_text(f"{line}.\n" * 30, encoding="utf-8")
    return path


def write_data(directory: Path, name: str, variant: int | None = None) -> tuple[Path, Path]:
    """(train, valid) files for model ``name``'s base task, or for the adapter task ``variant``."""
    directory.mkdir(parents=True, exist_ok=True)
    tag = "base" if variant is None else f"adapter{variant}"
    if FAMILIES[name] == "seq2seq":
        return (write_translation(directory / f"{tag}-train.tsv", 64, 1, variant),
                write_translation(directory / f"{tag}-valid.tsv", 8, 2, variant))
    if FAMILIES[name] == "classifier":
        shift = 0 if variant is None else 1 + variant % 2
        return (write_labels(directory / f"{tag}-train.jsonl", 1, shift),
                write_labels(directory / f"{tag}-valid.jsonl", 2, shift))
    return write_text(directory / f"{tag}-train.txt", variant), write_text(directory / f"{tag}-valid.txt", variant)


# ---- training ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Tiny models train fastest on one thread (and leave the other core to the rest of the machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_training(*argv: str) -> None:
    """``python -m training <argv>``, in-process (a UserError propagates)."""
    args = build_parser().parse_args(["--log-level", "WARNING", *argv])
    with one_thread():
        args.func(args)


def train_model(root: Path, name: str) -> Path:
    """Train model ``name`` into ``root/models/name`` (the run's state stays under ``root/runs``)."""
    train, valid = write_data(root / "data", name)
    run = root / "runs" / name
    run_training("train", FAMILIES[name], "--train", str(train), "--valid", str(valid), "--out", str(run),
                 *SIZES, "--max-len", MAX_LEN[name], "--max-steps", str(BASE_STEPS[name]), *BASE_LOOP, *LOOP)
    target = root / "models" / name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(run, target)
    return target


def train_placeholder_translator(root: Path) -> Path:
    """A tiny translator trained on protected pairs (its tokenizer keeps the sentinels) into ``root/model``."""
    train = write_placeholder_pairs(root / "train.tsv", 96, 1)
    valid = write_placeholder_pairs(root / "valid.tsv", 8, 2)
    run_training("train", "seq2seq", "--train", str(train), "--valid", str(valid), "--out", str(root / "run"),
                 *SIZES, "--max-len", "64", "--max-steps", "400", *BASE_LOOP, *LOOP)
    shutil.copytree(root / "run", root / "model")
    return root / "model"


_cache: dict[tuple[Path, int], Path] = {}  # (checkpoint, seed) -> trained adapter directory
_cache_lock = threading.Lock()
_cache_root: Path | None = None


def _cache_directory() -> Path:
    global _cache_root
    if _cache_root is None:
        _cache_root = Path(tempfile.mkdtemp(prefix="tserve-adapters-"))
        atexit.register(shutil.rmtree, _cache_root, ignore_errors=True)
    return _cache_root


def make_adapter(model_dir: Path, out_dir: Path, seed: int) -> Path:
    """Write a LoRA adapter of ``model_dir`` trained with ``lora`` on its seed's task into ``out_dir``.

    Only the PEFT files (adapter_config.json, adapter_model.safetensors) go to ``out_dir``, as an
    operator deploys them. Trained once per (checkpoint, seed) and process, then copied; the first
    time, it is checked to change the model's greedy outputs.
    """
    model_dir = Path(model_dir).resolve()
    with _cache_lock:
        trained = _cache.get((model_dir, seed))
        if trained is None:
            work = _cache_directory() / f"{model_dir.name}-{len(_cache)}"
            train, valid = write_data(work / "data", model_dir.name, seed)
            trained = work / "adapter"
            run_training("lora", "--base", str(model_dir), "--train", str(train), "--valid", str(valid),
                         "--out", str(trained), "--seed", str(seed), *ADAPTER_LOOP, *LOOP)
            check_adapter_changes_outputs(model_dir, trained)
            _cache[(model_dir, seed)] = trained
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        shutil.copyfile(trained / file, out_dir / file)
    return out_dir


# ---- checks ------------------------------------------------------------------------------------------

PROBES = ["hello", "the cat", "gold", "delete file 3", "i love this"]


def greedy_outputs(model_dir: Path, adapter_dir: Path | None, texts: list[str] = PROBES,
                   max_new_tokens: int = 12) -> list:
    """Greedy token ids (generators) or label probabilities (classifier) of ``texts``."""
    ckpt = load_checkpoint(model_dir, device="cpu")
    adapters = None
    if adapter_dir is not None:
        load_adapter(ckpt.model, adapter_dir, "check")
        adapters = "check"
    with torch.inference_mode():
        set_adapters(ckpt.model, adapters)
        if ckpt.family != "classifier":
            config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=ckpt.config.eos_id)
        if ckpt.family == "causal_lm":
            prompts = [ckpt.tokenizer.encode(t, add_bos=True) for t in texts]
            return [h[0].tokens for h in generate_causal(ckpt.model, prompts, config, adapters=adapters)]
        if ckpt.family == "seq2seq":
            sources = [ckpt.src_tokenizer.encode(t, add_eos=True) for t in texts]
            return [h[0].tokens for h in generate_seq2seq(ckpt.model, sources, config, adapters=adapters)]
        outs = []
        for t in texts:
            ids, seg = ckpt.tokenizer.encode_pair(t)
            outs.append(ckpt.model(torch.tensor([ids]), torch.tensor([seg]))[0].argmax(-1).item())
        return outs


def check_adapter_changes_outputs(model_dir: Path, adapter_dir: Path) -> None:
    """The adapter must change at least one greedy output (label, for the classifier) of the probes."""
    base, tuned = greedy_outputs(model_dir, None), greedy_outputs(model_dir, adapter_dir)
    assert base != tuned, f"adapter {adapter_dir} does not change any greedy output of {model_dir.name}: {base}"


def build_models(root: Path) -> tuple[Path, Path]:
    """Train the three tiny models and their ``ADAPTERS``; returns (models_dir, adapters_dir)."""
    for name in FAMILIES:
        train_model(root, name)
        make_adapter(root / "models" / name, root / "adapters" / name / ADAPTERS[name], ADAPTER_SEED)
    return root / "models", root / "adapters"
