"""Per-family glue for the commands: one Task subclass per model family."""

from __future__ import annotations

from training.tasks.base import Task, TaskOptions
from training.tasks.causal_lm import CausalLMTask
from training.tasks.classifier import ClassifierTask
from training.tasks.seq2seq import Seq2SeqTask

TASKS: dict[str, type[Task]] = {t.family: t for t in (Seq2SeqTask, ClassifierTask, CausalLMTask)}

__all__ = ["TASKS", "Task", "TaskOptions"]
