"""Saving models in the layout PaddleFormers reads."""

from .export import save_model

__all__ = ["save_model"]
