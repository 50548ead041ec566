"""The configuration of an ERNIE-4.5-VL model folder written by ernie_moe, for transformers' ``AutoConfig`` with
``trust_remote_code`` (how vLLM and SGLang read such a folder): every key of config.json as an attribute, the
vision section as a config of its own."""

from transformers import PretrainedConfig


class Ernie4_5_VLVisionConfig(PretrainedConfig):
    model_type = "DFNRope_vision_transformer"

    def __init__(self, depth=32, embed_dim=1280, hidden_size=None, num_heads=16, mlp_ratio=4.0, patch_size=14,
                 spatial_merge_size=2, in_channels=3, in_chans=None, hidden_act="quick_gelu", **kwargs):
        self.depth, self.embed_dim, self.num_heads, self.mlp_ratio = depth, embed_dim, num_heads, mlp_ratio
        self.hidden_size = embed_dim if hidden_size is None else hidden_size
        self.patch_size, self.spatial_merge_size, self.hidden_act = patch_size, spatial_merge_size, hidden_act
        self.in_channels = in_channels if in_chans is None else in_chans
        self.in_chans = self.in_channels
        super().__init__(**kwargs)


class Ernie4_5_VLMoEConfig(PretrainedConfig):
    model_type = "ernie4_5_moe_vl"
    sub_configs = {"vision_config": Ernie4_5_VLVisionConfig}

    def __init__(self, vision_config=None, **kwargs):
        if isinstance(vision_config, dict):
            vision_config = Ernie4_5_VLVisionConfig(**vision_config)
        self.vision_config = vision_config if vision_config is not None else Ernie4_5_VLVisionConfig()
        super().__init__(**kwargs)
