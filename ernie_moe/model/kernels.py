"""Paddle's fused kernels, chosen in one place.

SwiGLU runs Paddle's fused ``swiglu`` on every device: it has a CPU kernel, so the code GPUs run is the
code tested here. Paddle's fused RMSNorm has no CPU kernel (its AVX-512 variant stops a CPU without
AVX-512 with SIGILL), so it runs only on a GPU; the plain float32 formula is the reference the doctor
checks it against (``python -m ernie_moe.doctor``). A fused kernel that fails its first call on a device
and dtype falls back to the plain path, once, with a warning.
"""

from __future__ import annotations

import warnings

import paddle
import paddle.nn.functional as F

_FUSED_RMS_NORM: dict[tuple[str, str], bool] = {}  # (place, dtype) -> whether the fused kernel runs there


def swiglu(gate_up: paddle.Tensor) -> paddle.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` on its last axis."""
    return F.swiglu(gate_up)


def plain_rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    """In float32 whatever the input dtype, cast back at the end."""
    h = x.astype("float32")
    h = h * paddle.rsqrt(h.pow(2).mean(axis=-1, keepdim=True) + eps)
    return (h * weight.astype("float32")).astype(x.dtype)


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    if uses_fused_rms_norm(x):
        key = (str(x.place), str(x.dtype))
        try:
            return F.rms_norm(x, x.shape[-1:], weight.astype(x.dtype), eps)[0]
        except (RuntimeError, NotImplementedError, ValueError) as error:
            _FUSED_RMS_NORM[key] = False
            warnings.warn(f"Paddle's fused rms_norm failed on {key[0]} in {key[1]} ({error}); "
                          "using the plain RMSNorm there.", stacklevel=2)
    return plain_rms_norm(x, weight, eps)


def uses_fused_rms_norm(x: paddle.Tensor) -> bool:
    """On a GPU, unless the fused kernel has failed there in this dtype."""
    return x.place.is_gpu_place() and _FUSED_RMS_NORM.get((str(x.place), str(x.dtype)), True)


def chosen_on(place) -> str:
    """Which kernels run on ``place``, for the doctor's report."""
    fused_norm = place.is_gpu_place() and all(ok for (p, _), ok in _FUSED_RMS_NORM.items() if p == str(place))
    return f"swiglu fused, rms_norm {'fused' if fused_norm else 'plain'}"
