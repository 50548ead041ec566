"""Generation and evaluation off the training loop: a model folder, prompts, a key/value cache."""

from .decoding import Decoding, Generated, generate, generate_batch
from .kv_cache import KVCache, forward_cached
from .model_folder import LoadedModel, folder_run_config, load_model_folder
from .prompts import ContextTooLong, UsageError, check_room, prompt_encoder
from .speculative import generate_drafting

__all__ = ["ContextTooLong", "Decoding", "Generated", "KVCache", "LoadedModel", "UsageError", "check_room",
           "folder_run_config", "forward_cached", "generate", "generate_batch", "generate_drafting",
           "load_model_folder", "prompt_encoder"]
