"""Default recipes: what `python -m training recipe {quick,quality}` prepares, trains and measures.

A tier names, for each family, the base model's sizes and number of training steps and one LoRA adapter
that specialises it on a domain the base never saw:

- translation (seq2seq, en->es): the base is trained on every package's messages but one
  (``translation_package``: PostgreSQL's server messages); the adapter on that package's only;
- langid (classifier): the base on software messages; the adapter on the ISO code lists'
  names of languages, countries, currencies and scripts (``langid_domain_prefix``), another domain;
- code (causal_lm): the base on the stdlib's non-test files, the adapter on its test files.

Everything is measured on test splits the models never trained on, against trivial baselines on
the same splits (training.baselines): the hash split of each corpus and, for the catalog corpora, the
packages held out whole (test-heldout, training.corpora.PackageHoldout). The stages are in
training.recipe_run.

Every training phase runs a fixed number of optimizer steps with a fixed seed (:data:`SEED`), never a time
budget: a busy machine takes longer and trains the same models as an idle one. The minutes in the table are
only what the recipe's ETA expects before it has measured anything.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from training.arch import ModelSizes
from training.runs import LORA_LOOP, LORA_TARGETS, AdapterSpec, EvalRun, Loop, SplitFractions

# Family -> the corpus kind of `prepare` and the file suffix of its splits.
CORPUS_KIND = {"seq2seq": "translation", "classifier": "langid", "causal_lm": "code"}
SPLIT_SUFFIX = {"translation": ".tsv", "langid": ".tsv", "code": ".txt"}
HELDOUT_KINDS = frozenset({"translation", "langid"})  # the corpora built from catalogs hold packages out


@dataclass(frozen=True)
class FamilyRecipe:
    """One family's base model and adapter: what `train`, `lora` and `evaluate` run with, and how long they take."""

    model: str  # the model's name: its directory under models/ (what the service calls it)
    family: str  # seq2seq | classifier | causal_lm
    adapter: str  # the adapter's name: its directory under adapters/<model>/
    sizes: ModelSizes  # the base model's sizes and architecture
    vocab_size: int
    train_loop: Loop  # the base's training loop: its max_steps end it, on every machine
    train_minutes: float  # the ETA's guess for train_loop (on a quiet 2-core machine); never a budget
    lora: AdapterSpec
    lora_loop: Loop  # the adapter's training loop: its max_steps end it
    lora_minutes: float  # the ETA's guess for lora_loop
    beams: int = EvalRun.beams  # seq2seq beam size of the evaluations
    eval_minutes: float = 0.5  # the ETA's guess for the three evaluations and the baselines

    @property
    def kind(self) -> str:
        return CORPUS_KIND[self.family]

    @property
    def heldout(self) -> bool:
        """Whether the base corpus holds whole packages out (its test-heldout split)."""
        return self.kind in HELDOUT_KINDS


@dataclass(frozen=True)
class Tier:
    """A whole recipe: the three families and the corpora's domains."""

    name: str
    translation: FamilyRecipe
    langid: FamilyRecipe
    code: FamilyRecipe
    lang: str = "es"  # translation target language
    translation_package: str = "postgres-15"  # held out of the translation base, the adapter's domain
    langid_domain_prefix: str = "iso_"  # packages held out of the langid base, the adapter's domain
    # Cap on the files of each code corpus (a stable sample): keeps tokenizing and evaluating them to
    # seconds. Tiers share --data, so they must agree on every corpus flag.
    code_max_files: int | None = 400
    langdetect: bool = True  # score the langdetect baseline (needs the langdetect package)
    fractions: SplitFractions = SplitFractions()  # of every corpus's records, to valid and test

    @property
    def families(self) -> tuple[FamilyRecipe, ...]:
        return (self.translation, self.langid, self.code)


# ---- the default tiers: one table ---------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """What a family's recipe is in every tier."""

    model: str
    family: str
    adapter: str
    arch: str
    batch_tokens: int


@dataclass(frozen=True)
class Phase:
    """A training phase in a tier: its fixed length and schedule (the state is saved at every validation)."""

    steps: int  # optimizer steps: what ends the phase, so that every machine trains the same model
    minutes: float  # about how long the steps take on a quiet 2-core machine: the ETA's first guess only
    eval_every: int
    lr: float
    warmup: int


@dataclass(frozen=True)
class Shape:
    """What a tier gives one family: the base model's sizes, the base's and the adapter's phases."""

    layers: int
    d_model: int  # the feed-forward width is 4 x d_model, with 4 heads
    vocab_size: int
    max_len: int
    dropout: float
    base: Phase
    adapter: Phase
    eval_minutes: float
    valid_examples: int = Loop.valid_examples  # seq2seq: examples decoded for BLEU at each validation
    beams: int = EvalRun.beams


FAMILIES = (
    Family(model="translation", family="seq2seq", adapter="postgres", arch="paper", batch_tokens=2048),
    Family(model="langid", family="classifier", adapter="iso", arch="bert", batch_tokens=4096),
    Family(model="code", family="causal_lm", adapter="tests", arch="gpt2", batch_tokens=4096),
)
SEED = 1  # of every phase of every tier: with the fixed steps, the same weights wherever the recipe runs
ADAPTER = AdapterSpec(rank=16, alpha=32.0, targets=LORA_TARGETS)  # every Linear of every layer

# fmt: off
TABLE: dict[str, dict[str, Shape]] = {
    # About 13 minutes of wall time on 2 quiet CPU cores, all stages included, with --jobs 2 (longer on a busy
    # machine, for the same models): translation trains in one process while langid, then code, train in the other.
    "quick": {
        "translation": Shape(layers=2, d_model=128, vocab_size=3000, max_len=128, dropout=0.0,
                             base=Phase(steps=1100, minutes=11.0, eval_every=300, lr=2e-3, warmup=200),
                             adapter=Phase(steps=200, minutes=1.0, eval_every=100, lr=3e-3, warmup=30),
                             eval_minutes=0.5, valid_examples=100, beams=1),
        "langid": Shape(layers=2, d_model=128, vocab_size=3000, max_len=64, dropout=0.0,
                        base=Phase(steps=450, minutes=2.0, eval_every=150, lr=2e-3, warmup=50),
                        adapter=Phase(steps=250, minutes=1.0, eval_every=100, lr=3e-3, warmup=20),
                        eval_minutes=0.5),
        "code": Shape(layers=2, d_model=128, vocab_size=3000, max_len=128, dropout=0.0,
                      base=Phase(steps=250, minutes=5.0, eval_every=400, lr=3e-3, warmup=50),
                      adapter=Phase(steps=100, minutes=2.0, eval_every=200, lr=3e-3, warmup=20),
                      eval_minutes=1.5),
    },
    # About 50 minutes of wall time on 2 quiet CPU cores with --jobs 2: about twice the parameters of the quick
    # models and four times their training time, since compute, not data, limits both tiers on a CPU.
    "quality": {
        "translation": Shape(layers=2, d_model=192, vocab_size=4000, max_len=128, dropout=0.05,
                             base=Phase(steps=3850, minutes=40.0, eval_every=500, lr=1.5e-3, warmup=300),
                             adapter=Phase(steps=290, minutes=4.0, eval_every=200, lr=2e-3, warmup=50),
                             eval_minutes=3.0, valid_examples=200, beams=4),
        "langid": Shape(layers=3, d_model=192, vocab_size=4000, max_len=64, dropout=0.1,
                        base=Phase(steps=450, minutes=8.0, eval_every=300, lr=1e-3, warmup=100),
                        adapter=Phase(steps=150, minutes=3.0, eval_every=200, lr=2e-3, warmup=50),
                        eval_minutes=1.5),
        "code": Shape(layers=3, d_model=192, vocab_size=4000, max_len=256, dropout=0.0,
                      base=Phase(steps=800, minutes=24.0, eval_every=300, lr=2e-3, warmup=100),
                      adapter=Phase(steps=130, minutes=4.0, eval_every=200, lr=2e-3, warmup=30),
                      eval_minutes=2.0),
    },
}
# fmt: on


def _loop(phase: Phase, batch_tokens: int, defaults: Loop, valid_examples: int = Loop.valid_examples) -> Loop:
    return replace(
        defaults,
        max_steps=phase.steps,
        max_minutes=None,  # the steps end a phase, never the clock
        seed=SEED,
        eval_every=phase.eval_every,
        save_every=phase.eval_every,
        lr=phase.lr,
        warmup=phase.warmup,
        batch_tokens=batch_tokens,
        valid_examples=valid_examples,
    )


def family_recipe(f: Family, shape: Shape) -> FamilyRecipe:
    """The recipe of family ``f`` in a tier that gives it ``shape``."""
    sizes = ModelSizes(
        layers=shape.layers,
        d_model=shape.d_model,
        heads=4,
        ffn=4 * shape.d_model,
        max_len=shape.max_len,
        dropout=shape.dropout,
        arch=f.arch,
    )
    return FamilyRecipe(
        model=f.model,
        family=f.family,
        adapter=f.adapter,
        sizes=sizes,
        vocab_size=shape.vocab_size,
        train_loop=_loop(shape.base, f.batch_tokens, Loop(), shape.valid_examples),
        train_minutes=shape.base.minutes,
        lora=ADAPTER,
        lora_loop=_loop(shape.adapter, f.batch_tokens, LORA_LOOP),
        lora_minutes=shape.adapter.minutes,
        beams=shape.beams,
        eval_minutes=shape.eval_minutes,
    )


TIERS = {
    name: Tier(name=name, **{f.model: family_recipe(f, shapes[f.model]) for f in FAMILIES})
    for name, shapes in TABLE.items()
}
