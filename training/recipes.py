"""Default recipes: what `python -m training recipe {quick,quality}` prepares, trains and measures.

A tier names, for each family, the base model's sizes and time budget and one LoRA adapter that
specialises it on a domain the base never saw:

- translation (seq2seq, en->es): the base is trained on every package's messages but one
  (``translation_package``: PostgreSQL's server messages); the adapter on that package's only;
- langid (classifier): the base on software messages; the adapter on the ISO code lists'
  names of languages, countries, currencies and scripts (``langid_domain_prefix``), another domain;
- code (causal_lm): the base on the stdlib's non-test files, the adapter on its test files.

Everything is measured on test splits the models never trained on, against trivial baselines on
the same splits (training.baselines). The stages are in training.recipe_run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Family -> the corpus kind of `prepare` and the file suffix of its splits.
CORPUS_KIND = {"seq2seq": "translation", "classifier": "langid", "causal_lm": "code"}
SPLIT_SUFFIX = {"translation": ".tsv", "langid": ".tsv", "code": ".txt"}


@dataclass(frozen=True)
class FamilyRecipe:
    """One family's base model and adapter: `train` and `lora` flags and their time budgets."""

    model: str  # the model's name: its directory under models/ (what the service calls it)
    family: str  # seq2seq | classifier | causal_lm
    adapter: str  # the adapter's name: its directory under adapters/<model>/
    train_flags: tuple[str, ...]  # sizes and loop flags of `train` (no data, --out or --max-minutes)
    train_minutes: float  # --max-minutes of the base's training (its share of the tier's budget)
    lora_flags: tuple[str, ...]
    lora_minutes: float
    eval_flags: tuple[str, ...] = ()  # extra `evaluate` flags (e.g. --beams)
    eval_minutes: float = 0.5  # the ETA's guess for the three evaluations and the baselines

    @property
    def kind(self) -> str:
        return CORPUS_KIND[self.family]


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
    prepare_flags: dict[str, tuple[str, ...]] = field(default_factory=dict)  # extra `prepare` flags per kind

    @property
    def families(self) -> tuple[FamilyRecipe, ...]:
        return (self.translation, self.langid, self.code)

    @property
    def budget_minutes(self) -> float:
        return sum(f.train_minutes + f.lora_minutes + f.eval_minutes for f in self.families)


def _loop(steps: int, eval_every: int, lr: float, warmup: int, batch_tokens: int) -> tuple[str, ...]:
    return (
        "--max-steps",
        str(steps),
        "--eval-every",
        str(eval_every),
        "--save-every",
        str(eval_every),
        "--lr",
        str(lr),
        "--warmup",
        str(warmup),
        "--batch-tokens",
        str(batch_tokens),
    )


def _sizes(
    layers: int, d_model: int, heads: int, ffn: int, vocab: int, max_len: int, dropout: float
) -> tuple[str, ...]:
    return (
        "--layers",
        str(layers),
        "--d-model",
        str(d_model),
        "--heads",
        str(heads),
        "--ffn",
        str(ffn),
        "--vocab-size",
        str(vocab),
        "--max-len",
        str(max_len),
        "--dropout",
        str(dropout),
    )


LORA_ALL = ("--targets", "q_proj,k_proj,v_proj,out_proj,fc1,fc2")

# Under 15 minutes of wall time on 2 CPU cores, all stages included, with --jobs 2: translation
# trains in one process while langid, then code, train in the other. The budgets bind, not the steps.
QUICK = Tier(
    name="quick",
    translation=FamilyRecipe(
        model="translation",
        family="seq2seq",
        adapter="postgres",
        train_flags=(
            "--arch",
            "paper",
            *_sizes(2, 128, 4, 512, 3000, 128, 0.0),
            *_loop(100_000, 300, 2e-3, 200, 2048),
            "--valid-examples",
            "100",
        ),
        train_minutes=11.0,
        lora_flags=("--rank", "16", "--alpha", "32", *LORA_ALL, *_loop(100_000, 100, 3e-3, 30, 2048)),
        lora_minutes=1.0,
        eval_flags=("--beams", "1"),
        eval_minutes=0.5,
    ),
    langid=FamilyRecipe(
        model="langid",
        family="classifier",
        adapter="iso",
        train_flags=("--arch", "bert", *_sizes(2, 128, 4, 512, 3000, 64, 0.0), *_loop(100_000, 150, 2e-3, 50, 4096)),
        train_minutes=2.0,
        lora_flags=("--rank", "16", "--alpha", "32", *LORA_ALL, *_loop(100_000, 100, 3e-3, 20, 4096)),
        lora_minutes=1.0,
        eval_minutes=0.5,
    ),
    code=FamilyRecipe(
        model="code",
        family="causal_lm",
        adapter="tests",
        train_flags=("--arch", "gpt2", *_sizes(2, 128, 4, 512, 3000, 128, 0.0), *_loop(100_000, 400, 3e-3, 50, 4096)),
        train_minutes=5.0,
        lora_flags=("--rank", "16", "--alpha", "32", *LORA_ALL, *_loop(100_000, 200, 3e-3, 20, 4096)),
        lora_minutes=1.5,
        eval_minutes=1.5,
    ),
    translation_package="postgres-15",
)

# About 50 minutes of wall time on 2 CPU cores with --jobs 2: about twice the parameters of the
# quick models and four times their training, since compute, not data, limits both tiers on a CPU.
QUALITY = Tier(
    name="quality",
    translation=FamilyRecipe(
        model="translation",
        family="seq2seq",
        adapter="postgres",
        train_flags=(
            "--arch",
            "paper",
            *_sizes(2, 192, 4, 768, 4000, 128, 0.05),
            *_loop(100_000, 500, 1.5e-3, 300, 2048),
            "--valid-examples",
            "200",
        ),
        train_minutes=40.0,
        lora_flags=("--rank", "16", "--alpha", "32", *LORA_ALL, *_loop(100_000, 200, 2e-3, 50, 2048)),
        lora_minutes=4.0,
        eval_flags=("--beams", "4"),
        eval_minutes=3.0,
    ),
    langid=FamilyRecipe(
        model="langid",
        family="classifier",
        adapter="iso",
        train_flags=("--arch", "bert", *_sizes(3, 192, 4, 768, 4000, 64, 0.1), *_loop(100_000, 300, 1e-3, 100, 4096)),
        train_minutes=8.0,
        lora_flags=("--rank", "16", "--alpha", "32", *LORA_ALL, *_loop(100_000, 200, 2e-3, 50, 4096)),
        lora_minutes=3.0,
        eval_minutes=1.5,
    ),
    code=FamilyRecipe(
        model="code",
        family="causal_lm",
        adapter="tests",
        train_flags=("--arch", "gpt2", *_sizes(3, 192, 4, 768, 4000, 256, 0.0), *_loop(100_000, 300, 2e-3, 100, 4096)),
        train_minutes=24.0,
        lora_flags=("--rank", "16", "--alpha", "32", *LORA_ALL, *_loop(100_000, 200, 2e-3, 30, 4096)),
        lora_minutes=4.0,
        eval_minutes=2.0,
    ),
    translation_package="postgres-15",
)

TIERS = {tier.name: tier for tier in (QUICK, QUALITY)}
