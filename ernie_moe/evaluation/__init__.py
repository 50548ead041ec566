"""Benchmarks in the field's formats: reading them, asking a model, and scoring its answers as the reference
harnesses do."""

from .answering import Answered, answer_benchmark
from .formats import KINDS, Benchmark, Item, read_benchmark
from .scoring import RULES, max_new_tokens

__all__ = ["KINDS", "RULES", "Answered", "Benchmark", "Item", "answer_benchmark", "max_new_tokens",
           "read_benchmark"]
