"""New weights for a served model while it serves, in vLLM's four phases (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``), carried by a folder of safetensors
under the server's ``--weight-updates`` folder: every tensor is checked against the model's names, shapes and dtypes
as it is staged, and the staged tensors are applied together at the finish, which a paused server takes (a failed
update leaves the weights, and the policy version the answers carry, as they were)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..checkpoint.errors import CheckpointError
from ..checkpoint.formats import SourceCheckpoint
from ..checkpoint.model_files import NUMPY_DTYPES, absent_correction_biases
from .openai_api import ApiError

BACKENDS = ("folder",)  # a collective group shared with the trainer is not offered here


class WeightUpdates:
    def __init__(self, model, root: Path | None):
        """``root``: the folder update folders must lie under (None: weight updates are off)."""
        self.model, self.root = model, root.resolve() if root is not None else None
        self.params = dict(model.stable_named_parameters())
        self.backend: str | None = None
        self.staged: dict[str, np.ndarray] | None = None  # between the start and the finish of an update

    def init(self, body: dict) -> dict:
        self._enabled()
        info = body.get("init_info") or {}
        backend = info.get("backend", "folder") if isinstance(info, dict) else None
        if backend not in BACKENDS:
            raise ApiError(400, f"init_info.backend must be one of {', '.join(BACKENDS)}, not {str(backend)[:50]!r}",
                           "init_info")
        self.backend = backend
        return {"backend": backend}

    def start(self) -> dict:
        self._enabled()
        if self.backend is None:
            raise ApiError(409, "no weight transfer set up: POST /init_weight_transfer_engine first")
        self.staged = {}
        return {"started": True}

    def update(self, body: dict) -> dict:
        """Stage the tensors of the folder ``update_info.path`` names (relative to the server's folder, or under
        it), each checked; a folder that fails stages nothing of its own."""
        self._enabled()
        if self.staged is None:
            raise ApiError(409, "no weight update under way: POST /start_weight_update first")
        info = body.get("update_info")
        path = info.get("path") if isinstance(info, dict) else None
        if not isinstance(path, str) or not path or "\x00" in path:
            raise ApiError(400, "update_info.path must name a folder of safetensors", "update_info")
        assert self.root is not None
        folder = (self.root / path).resolve()
        if not folder.is_relative_to(self.root):
            raise ApiError(400, f"{path[:200]} is not under the server's --weight-updates folder", "update_info")
        try:
            source = SourceCheckpoint(folder)  # read as a run reads a model folder: PaddleFormers' or HF's layout
            staged = {}
            for name in self.params:
                value, _ = source.paddle_tensor(name)
                if value is not None:
                    staged[name] = self._checked(name, value)
            # the zero correction bias a folder holds for the engines where the model routes without one
            for name, _ in absent_correction_biases(self.model):
                value, _ = source.paddle_tensor(name)
                if value is not None and value.any():
                    raise CheckpointError(f"tensor '{name}' shifts the routing, and the served model routes "
                                          "without a correction bias")
            unknown = sorted(set(source.names()) - set(source.used))
        except (CheckpointError, OSError, ValueError) as err:
            raise ApiError(400, str(err), "update_info") from None
        if unknown:
            raise ApiError(400, f"{path[:200]}: tensor '{unknown[0]}' is not a weight of the served model "
                                f"({len(unknown)} such)", "update_info")
        if not staged:
            raise ApiError(400, f"{path[:200]} holds no weight of the served model", "update_info")
        self.staged.update(staged)
        return {"staged": len(self.staged)}

    def finish(self) -> int:
        """Apply what was staged (the caller holds the model still); how many tensors changed."""
        self._enabled()
        if self.staged is None:
            raise ApiError(409, "no weight update under way: POST /start_weight_update first")
        staged, self.staged = self.staged, None
        for name, value in staged.items():
            self.params[name].set_value(value)
        return len(staged)

    def _checked(self, name: str, value: np.ndarray) -> np.ndarray:
        param = self.params[name]
        if list(value.shape) != list(param.shape):
            raise CheckpointError(f"tensor '{name}' has shape {list(value.shape)}; the served model's is "
                                  f"{list(param.shape)}")
        if value.dtype != NUMPY_DTYPES.get(param.dtype):
            raise CheckpointError(f"tensor '{name}' is {value.dtype}; the served model's is {param.dtype}")
        if not np.isfinite(value).all():
            raise CheckpointError(f"tensor '{name}' holds nan or inf")
        return value

    def _enabled(self) -> None:
        if self.root is None:
            raise ApiError(404, "weight updates are off: start the server with --weight-updates DIR",
                           code="not_found")
