"""A LoRA run's frozen base in 8 or 4 bits (``training.quantize_base: wint8 | wint4``, ERNIEKit's compute_type).

After the LoRA pairs are in, each linear layer of the language model (``parameter_kinds.BASE_LINEAR``) trades its
full-precision weight for :mod:`..nn.quant`'s integers and scales, quantised once from the loaded weights, and
its forward pass multiplies by the weight dequantised for the call. The weight's slice on this rank is
quantised where it lies: a column-parallel slice holds whole output columns, so its scales are the whole
weight's; a row-parallel slice holds some input rows of each column, so its per-column maximum is taken over
the tensor-parallel ranks, and its groups (wint4) must fall inside the slice. Every layout therefore holds the
integers and scales of one process. The base never trains, so nothing of it reaches a checkpoint or an adapter:
``export --merge-lora`` merges into the full-precision base read from its folder.

On every device the dequantise-then-matmul runs in plain Paddle ops; the memory saved is the weights'.
"""

from __future__ import annotations

import paddle.distributed as dist
from paddle import nn

from ..checkpoint.model_files import folder_config
from ..config.errors import ConfigError
from ..model.parameter_kinds import BASE_LINEAR
from ..nn.param_spec import describe, spec_of
from ..nn.quant import quantize, quantized_matmul
from ..parallel import tensor_parallel as tp
from ..parallel.pipeline import TrainedModel
from .lora import LoRALinear, linear_layers


class QuantizedLinear(nn.Layer):
    """A frozen linear layer (plain, column- or row-parallel) held as integers and scales."""

    def __init__(self, base: nn.Layer, mode: str, group_size: int, stable_name: str):
        super().__init__()
        self.mode, self.stable_name = mode, stable_name  # the layer's name in the base model's folder
        self.split = ("column" if isinstance(base, tp.ColumnParallelLinear)
                      else "row" if isinstance(base, tp.RowParallelLinear) else None)
        self.group = getattr(base, "group", None)
        self.sequence_parallel = getattr(base, "sequence_parallel", False)
        column_max = None
        if self.split == "row" and self.group is not None and self.group.nranks > 1:
            def column_max(peak):
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.group)
                return peak
        q, scale = quantize(base.weight.detach(), mode, group_size, column_max)
        self.register_buffer("quantized_weight", q)
        self.register_buffer("weight_scale", scale)
        spec = spec_of(base.weight)
        for buffer in (q, scale):  # fleet's broadcasts (a pipeline's among them) leave a rank's slice or expert alone
            describe(buffer, split=spec.split, local_to_rank=spec.local_to_rank)
        if getattr(base, "bias", None) is not None:
            self.bias = base.bias

    def forward(self, x):
        if self.split == "column":
            x = tp.enter_region(x, self.group, self.sequence_parallel)
        y = quantized_matmul(x, self.quantized_weight, self.weight_scale, self.mode)
        if getattr(self, "bias", None) is not None:
            y = y + self.bias
        if self.split == "row":
            y = tp.leave_region(y, self.group, self.sequence_parallel)
        return y


def refuse_a_quantized_base(folder: str) -> None:
    """ConfigError when the base model folder is already quantised: its weights are to be quantised here, once,
    from full precision (``export --merge-lora`` needs them too)."""
    config = folder_config(folder)
    if "quantization_config" in config or config.get("quantization"):
        raise ConfigError(f"training.model_name_or_path {folder} holds a quantised model (quantization_config in "
                          "its config.json): training.quantize_base quantises a full-precision base itself; give "
                          "the base in bfloat16 or float32")


def quantize_base(model: TrainedModel, mode: str, group_size: int) -> int:
    """Quantise every base linear layer of ``model`` (this rank's part); returns how many."""
    count = 0
    for name, parent, attr, layer in linear_layers(model):
        if not BASE_LINEAR.fullmatch(name):
            continue
        base = layer.base if isinstance(layer, LoRALinear) else layer
        rows = base.weight.shape[0]
        if mode == "wint4" and (rows % 2 or (group_size and rows % group_size)):
            raise ConfigError(f"training.quantize_group_size {group_size} does not divide the {rows} input rows of "
                              f"{name} on this rank (each group of a row-parallel weight lies on one rank); choose "
                              "a size that divides them, or 0 (one scale per output column)")
        quantized = QuantizedLinear(base, mode, group_size, name)
        if isinstance(layer, LoRALinear):  # the pair stays; the base weight goes, its integers are registered here
            layer._base = [quantized]
            del layer._parameters["weight"]
            layer.add_sublayer("quantized_base", quantized)
        else:
            setattr(parent, attr, quantized)
        count += 1
    return count
