"""Saving models in the layout PaddleFormers reads, and training checkpoints that load into any layout."""

from .checkpoint import load_checkpoint, start_checkpoint
from .errors import CheckpointError
from .lineage import Run, claim_output_dir, resolve
from .model_files import save_model
from .parts import TrainingParts

__all__ = ["CheckpointError", "Run", "TrainingParts", "claim_output_dir", "load_checkpoint", "resolve",
           "save_model", "start_checkpoint"]
