"""Optimizer, schedules, evaluation and the trainer loop."""

from .trainer import Trainer

__all__ = ["Trainer"]
