"""Memory planning: parameter counts, predicted peaks per pipeline stage, layouts that fit."""
