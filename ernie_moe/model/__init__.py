"""The single-device multimodal MoE model (``ernie_vl``) and its parts."""
