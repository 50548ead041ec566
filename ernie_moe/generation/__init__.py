"""Generation and evaluation off the training loop: a model folder, prompts, a key/value cache."""

from .decoding import Generated, generate
from .kv_cache import KVCache, forward_cached
from .model_folder import LoadedModel, folder_run_config, load_model_folder
from .prompts import UsageError, prompt_encoder

__all__ = ["Generated", "KVCache", "LoadedModel", "UsageError", "folder_run_config", "forward_cached", "generate",
           "load_model_folder", "prompt_encoder"]
