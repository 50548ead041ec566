"""ERNIE-4.5-VL-style heterogeneous multimodal mixture-of-experts training on PaddlePaddle fleet."""

__version__ = "0.1.0"
