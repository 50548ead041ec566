"""Saving models in the layout PaddleFormers reads, and training checkpoints that load into any layout."""

from .checkpoint import CheckpointError, load_checkpoint, resolve, save_checkpoint
from .model_files import save_model

__all__ = ["CheckpointError", "load_checkpoint", "resolve", "save_checkpoint", "save_model"]
