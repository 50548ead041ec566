"""The reference model of a preference run, and its pass over each step's pairs.

The reference is the model the run starts from. A LoRA run has it already: the base with the adapters switched
off, so nothing is copied. A full fine-tune keeps a frozen copy of the weights that train, on the ranks that hold
them (the layout's own placement, no gradients, no optimizer states), and swaps it in for the reference pass. The
routers' correction biases are kept too, so the reference routes as the starting model did however the
aux-loss-free rule moves the policy's. The reference pass runs in evaluation mode (no router statistics, no
router losses, no dropout), as the pass of a separate frozen model would.
"""

from __future__ import annotations

from contextlib import contextmanager

import paddle

from ..finetune.lora import LoRALinear
from ..model.parameter_kinds import is_router_bias


class ReferenceModel:
    def __init__(self, model, lora: bool):
        self.adapters = [layer for layer in model.sublayers() if isinstance(layer, LoRALinear)] if lora else []
        kept = [p for name, p in model.named_parameters()
                if is_router_bias(name) or (not lora and not p.stop_gradient)]
        self.weights = [(p, p.detach().clone()) for p in kept]

    @contextmanager
    def active(self):
        """Inside, the model computes as the reference (every rank of the layout enters together)."""
        self._swap()
        for layer in self.adapters:
            layer.switched_on = False
        try:
            yield
        finally:
            for layer in self.adapters:
                layer.switched_on = True
            self._swap()

    @paddle.no_grad()
    def _swap(self) -> None:
        """The held weights into the parameters and theirs into the holders, one tensor at a time (no second
        copy of the model at any moment)."""
        for param, held in self.weights:
            theirs = param.detach().clone()
            param.set_value(held)
            paddle.assign(theirs, output=held)
