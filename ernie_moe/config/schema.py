"""Typed configuration sections.

Field names follow the ERNIE 4.5 model config (``model``) and the PaddleNLP / PaddleFormers
trainer arguments (``training``, ``parallel``) so that users can carry their settings over.
A field's ``choices`` metadata lists the values it accepts; its docstring is the config reference (docs/config.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The names training.lora_targets and training.freeze accept (finetune holds what each one selects).
LORA_TARGET_GROUPS = ("attention", "mlp", "shared_experts", "text_experts", "vision_experts", "vit", "adapter", "mtp")
MTP_MAX_DEPTH = 4  # the most multi-token prediction depths (the data's host counts cover as many)
FREEZE_PARTS = ("vision", "adapter", "lm", "embedding", "head", "router", "mtp")


def choice(default, *options, doc=""):
    return field(default=default, metadata={"choices": options, "doc": doc})


# training.stage's values: the objectives this package registers, and any a program registers beside them
# (``objectives.register``), which adds its name here so that a config may name it
STAGES = ["sft", "dpo", "grpo"]


def opt(default, doc=""):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class VisionConfig:
    depth: int = opt(2, "ViT blocks")
    embed_dim: int = opt(32, "ViT width (= model.pixel_hidden_size)")
    num_heads: int = opt(2, "ViT attention heads")
    mlp_ratio: float = opt(2.0, "ViT MLP width / embed_dim")
    patch_size: int = opt(14, "square patch side in pixels")
    spatial_merge_size: int = opt(2, "patches merged per side by the adapter")
    in_channels: int = opt(3, "image channels")
    hidden_act: str = choice("quick_gelu", "quick_gelu", "gelu", doc="ViT MLP activation")
    rope_theta: float = opt(10000.0, "base of the ViT's 2D rotary positions")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = opt(128, "token vocabulary (must cover the tokenizer)")
    hidden_size: int = opt(64, "decoder width")
    intermediate_size: int = opt(128, "dense SwiGLU width")
    num_hidden_layers: int = opt(2, "decoder layers")
    num_attention_heads: int = opt(4, "query heads")
    num_key_value_heads: int = opt(2, "key/value heads (grouped-query attention)")
    head_dim: int = opt(16, "width of one attention head")
    max_position_embeddings: int = opt(4096, "longest sequence the model accepts (bounds data.max_seq_len)")
    rope_theta: float = opt(10000.0, "rotary base")
    rms_norm_eps: float = opt(1e-5, "RMSNorm epsilon")
    tie_word_embeddings: bool = opt(True, "share the embedding and LM-head matrix")
    initializer_range: float = opt(0.02, "std of the normal weight init")
    rope_3d: bool = opt(True, "3D (t, h, w) rotary positions for image tokens")
    freq_allocation: int = opt(2, "rotary frequency slots (of head_dim/2) given to the t axis")
    moe_num_experts: list[int] = opt([4, 4], "routed experts per modality: [text, vision], [shared pool], "
                                                    "or [] (dense model)")
    moe_intermediate_size: list[int] = opt([64, 32], "expert width per modality: [text, vision]")
    moe_k: int = opt(2, "experts chosen per token")
    moe_layer_start_index: int | list[int] = opt(1, "first MoE layer (per modality when a list)")
    moe_layer_end_index: int | list[int] = opt(-1, "last MoE layer, -1 = last layer (per modality when a list)")
    moe_layer_interval: int = opt(1, "layer i is MoE when (i + 1) % interval == 0 and inside the range")
    moe_num_shared_experts: int = opt(1, "shared experts, each of width moe_intermediate_size[0]")
    moe_capacity: list[float] = opt([], "[train, eval, eval_when_tokens_lt_experts] capacity factors; [] = dropless "
                                        "(written to config.json as the expert count, which PaddleFormers reads as "
                                        "room for every token)")
    moe_gate_act: str = choice("softmax", "softmax", "sigmoid", doc="router score function")
    moe_norm_gate_logits: bool = opt(True, "renormalise the top-k weights to sum to 1")
    moe_use_hard_gate: bool = opt(True, "modality-isolated routing: text tokens to text experts, images to vision")
    moe_use_aux_free: bool = opt(False, "aux-loss-free balancing with a correction bias")
    moe_aux_free_update_coef: float = opt(1e-3, "step size of the correction-bias update")
    moe_aux_loss_lambda: float | list[float] = opt(1e-2, "load-balance loss weight (per modality when a list)")
    moe_z_loss_lambda: float | list[float] = opt(1e-4, "router z-loss weight (per modality when a list)")
    global_aux_loss: bool = opt(False, "router loss statistics over the tokens of every data-parallel rank "
                                       "(losses then do not depend on how the batch is split)")
    moe_orthogonal_loss_lambda: float | list[float] = opt(1e-2, "router orthogonal loss weight")
    num_nextn_predict_layers: int = opt(0, "multi-token prediction depths (ERNIE 4.5: 1): depth k predicts the "
                                           "token k + 1 ahead; dense layers, trained with the LM loss")
    multi_token_pred_lambda: float = opt(0.1, "weight of the MTP loss: lambda x the mean of the depths' losses "
                                              "(PaddleFormers' mtp_loss_scaling_factor)")
    im_patch_id: int = opt(4, "token id of the image placeholder (must equal the tokenizer's)")
    spatial_conv_size: int = opt(2, "adapter: patches merged per side")
    temporal_conv_size: int = opt(2, "adapter: frames merged in time (a still image repeats its frame)")
    pixel_hidden_size: int = opt(32, "ViT output width fed to the adapter")
    vision_config: VisionConfig = field(default_factory=VisionConfig, metadata={"doc": "the ViT encoder"})

    @property
    def num_modalities(self) -> int:
        """Expert groups: 2 = text and vision experts, 1 = one pool for every token."""
        return len(self.moe_num_experts)

    def moe_layer_range(self) -> tuple[list[int], list[int]]:
        """(starts, ends) per modality, with -1 resolved to the last layer."""
        n = self.num_modalities
        starts = _per_modality(self.moe_layer_start_index, n)
        ends = [e if e >= 0 else self.num_hidden_layers + e for e in _per_modality(self.moe_layer_end_index, n)]
        return [int(s) for s in starts], [int(e) for e in ends]

    def moe_modalities_at(self, layer: int) -> list[int]:
        """Modalities whose experts exist in decoder layer ``layer`` (empty list = dense layer)."""
        if (layer + 1) % self.moe_layer_interval != 0:
            return []
        starts, ends = self.moe_layer_range()
        return [m for m in range(self.num_modalities) if starts[m] <= layer <= ends[m]]

    def loss_weight(self, name: str, modality: int) -> float:
        return float(_per_modality(getattr(self, name), self.num_modalities)[modality])


def _per_modality(value, n: int) -> list:
    if isinstance(value, list):
        return value if len(value) == n else [value[0]] * n
    return [value] * n


@dataclass(frozen=True)
class VideoReading:
    """How a video file becomes frames."""

    fps: float = 2.0  # frames per second of video kept ...
    min_frames: int = 16  # ... but at least this many ...
    max_frames: int = 180  # ... and at most this many
    timestamp_font: str = ""  # a TrueType font to draw each frame's time with; "" = none



@dataclass(frozen=True)
class DataConfig:
    dataset: str = choice("synthetic", "synthetic", "jsonl", doc="bundled synthetic shapes, or your own data "
                                                                  "(train_path: JSONL files, folders of shards, "
                                                                  "globs)")
    train_path: str | list[str] = opt("", "training data (dataset: jsonl), or a list of sources: a JSONL file, a "
                                          "folder of shards (.jsonl, WebDataset .tar, Parquet) or a glob of them")
    train_probs: list[float] = opt([], "with several train_path files: the probability each sample is drawn from "
                                       "each (summing to 1); [] = the files one after another")
    text_path: str | list[str] = opt("", "text-only sources (as train_path takes them) mixed in beside train_path "
                                         "at modality_ratio (ERNIEKit's text_dataset_path)")
    text_probs: list[float] = opt([], "with several text_path files: how their share is split (summing to 1); "
                                      "[] = evenly")
    modality_ratio: list[float] = opt([1.0, 1.0], "with text_path: samples drawn from train_path and text_path "
                                                  "files in this ratio (ERNIEKit's modality_ratio)")
    eval_path: str = opt("", "held-out data (dataset: jsonl), one source as train_path takes them; empty = no "
                             "evaluation")
    format: str = choice("auto", "auto", "caption", "messages", "erniekit",
                         doc="JSONL record shape: each record's own (auto), or only this one (others are skipped "
                             "as wrong_format); erniekit = ERNIEKit's VL (image_info / text_info) and text (src / "
                             "tgt) SFT records")
    enable_thinking: bool = opt(False, "the Thinking model's form: an answer without <think> ... </think> opens "
                                       "with the empty think block (not trained on; ERNIEKit records: then only "
                                       "the last answer trains); a record's own enable_thinking wins")
    report_samples: int = opt(64, "samples the start-up data report encodes (data_report.json); 0 = none")
    tokenizer_path: str = opt("", "directory with a tokenizer: tokenizer.model (SentencePiece) or vocab.json (a word "
                                  "list); empty = training.model_name_or_path's, else built-in")
    max_seq_len: int = opt(64, "tokens per packed row")
    overlong: str = choice("truncate", "truncate", "skip", doc="what happens to a sample longer than max_seq_len")
    image_size: int = opt(56, "synthetic images: side in pixels")
    max_image_side: int = opt(0, "JSONL images and video frames: with a value, resized by their longest side to at "
                                 "most this many pixels (rounded to patch x merge) instead of ERNIE's pixel budget, "
                                 "a rule no image processor of PaddleFormers or transformers follows; 0 = the "
                                 "pixel budget")
    image_min_pixels: int = opt(3136, "ERNIE-4.5-VL's pixel-budget resize grows smaller images to this many pixels")
    image_max_pixels: int = opt(200_704, "ERNIE-4.5-VL's pixel-budget resize: sides multiples of 28, at most this "
                                         "many pixels (448 x 448; ERNIE: 1003520 = 28 x 28 x 1280)")
    video_min_pixels: int = opt(3136, "the pixel budget's least pixels of a video frame (ERNIE: 28 x 28 x 299)")
    video_max_pixels: int = opt(200_704, "the pixel budget's most pixels of a video frame (ERNIE: 28 x 28 x 1196)")
    video_fps: float = opt(2.0, "video files: frames kept per second of video (ERNIE's sampling: the middle frame "
                                "of each of that many equal intervals) ...")
    video_min_frames: int = opt(16, "... but at least this many ...")
    video_max_frames: int = opt(180, "... and at most this many (frame lists are used as given)")
    video_timestamp_font: str = opt("", "video files: a TrueType font file to draw each frame's time on it with, "
                                        "as ERNIE-4.5-VL's processor does (its font: Roboto-Regular.ttf); '' = "
                                        "frames as decoded")
    max_image_pixels: int = opt(50_000_000, "JSONL images and video frames: larger ones (width x height, read from "
                                            "the header before decoding) are skipped as image_too_large or "
                                            "video_too_large")
    num_train_samples: int = opt(20000, "synthetic training samples per epoch")
    num_eval_samples: int = opt(256, "synthetic held-out samples")
    blank_images: bool = opt(False, "replace every image with zeros (control run: vision carries no signal)")
    num_workers: int = opt(0, "background processes that read, decode and encode training samples (same order "
                              "as 0); 0 = in the training loop")
    balance: str = choice("tokens", "tokens", "vision",
                          doc="how a global micro-batch's rows are dealt to the data ranks: tokens (each rank its "
                              "contiguous share: the same rows and tokens each) or vision (as many rows each, dealt "
                              "so that each rank's image and video patches, the ViT's work, are even); the global "
                              "batch, so the losses, the same either way")
    read_ahead_steps: int = opt(1, "steps whose rows are read and encoded in the background while the model "
                                   "trains, so that a slow shard or a large video does not stall a step (memory: "
                                   "that many steps of this rank's rows); 0 = read when the step asks")
    index_dir: str = opt("", "where each data set's length index is kept, under a key of the data's identity and the "
                             "encoding settings (measured once, read back by later runs); '' = "
                             "$XDG_CACHE_HOME/ernie_moe/data_index (~/.cache/...)")

    @property
    def pixel_budget(self) -> tuple[int, int] | None:
        """(min, max) pixels of ERNIE's resize, or None for the longest-side rule."""
        return None if self.max_image_side else (self.image_min_pixels, self.image_max_pixels)

    @property
    def video_reading(self) -> VideoReading:
        return VideoReading(self.video_fps, self.video_min_frames, self.video_max_frames, self.video_timestamp_font)

    @property
    def video_budget(self) -> tuple[int, int] | None:
        """(min, max) pixels of a video frame under ERNIE's resize, or None for the longest-side rule."""
        return None if self.max_image_side else (self.video_min_pixels, self.video_max_pixels)

    @property
    def train_files(self) -> list[str]:
        """``train_path`` as a list of files."""
        return _files(self.train_path)

    @property
    def text_files(self) -> list[str]:
        """``text_path`` as a list of files."""
        return _files(self.text_path)


def _files(paths: str | list[str]) -> list[str]:
    return list(paths) if isinstance(paths, list) else ([paths] if paths else [])


# benchmark file kinds (ernie_moe.evaluation reads and scores them)
BENCHMARK_KINDS = ("mcq", "mmbench", "mmmu", "chartqa", "docvqa", "infovqa", "ocrbench", "text_mcq")
# a tokenizer folder holds one of these (data.encoding.tokenizer.tokenizer_in reads them)
TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "tokenizer_config.json")

# training.offload_optim: optimizer states of one visit to the device (the planner counts with it too)
OFFLOAD_BUCKET_BYTES = 2 ** 30


@dataclass(frozen=True)
class PreferenceConfig:
    """``training.dpo``: the preference stage's settings (``training.stage: dpo``)."""

    loss: str = choice("sigmoid", "sigmoid", "ipo", "simpo", "kto_pair", "dpop",
                       doc="the preference loss (DPO's sigmoid, IPO, SimPO, paired KTO, DPO-Positive)")
    beta: float = opt(0.1, "beta, the strength of the tie to the reference model (SimPO: the reward "
                           "scale)")
    label_smoothing: float = opt(0.0, "the share of pairs assumed mislabelled (cDPO; sigmoid, dpop, simpo)")
    simpo_gamma: float = opt(0.5, "SimPO's target reward margin gamma")
    dpop_lambda: float = opt(50.0, "DPO-Positive's lambda, the weight of its penalty on a chosen answer "
                                   "that lost probability")
    normalize_length: bool = opt(False, "divide each answer's log-probability by its token count (SimPO "
                                        "always does)")
    sft_weight: float = opt(0.0, "add this multiple of the chosen answer's mean token cross-entropy")
    reference: str = choice("model", "model", "precomputed",
                            doc="the reference's log-probabilities from the starting weights kept beside "
                                "the policy (LoRA: the base, its adapters switched off), or computed for every "
                                "pair in one pass before the first step and kept in the output folder (no "
                                "reference weights held)")


@dataclass(frozen=True)
class PolicyConfig:
    """``training.rl``: the GRPO family's settings (``training.stage: grpo``)."""

    loss: str = choice("grpo", "grpo", "dr_grpo", "dapo", "gspo",
                       doc="the policy loss (GRPO; Dr. GRPO: no per-group std, a constant divisor; DAPO: a "
                           "mean over every answer token; GSPO: one clipped ratio per answer, suited to MoE)")
    group_size: int = opt(4, "answers sampled per prompt (a group; advantages are relative within it)")
    updates_per_rollout: int = opt(1, "optimizer steps each rollout serves, one mini-batch of its answers "
                                      "each (the sampling policy's log-probabilities kept for all of them)")
    temperature: float = opt(1.0, "the sampling temperature; the loss reads the logits divided by it too")
    top_p: float = opt(1.0, "sample from the smallest set of tokens holding this much probability")
    max_new_tokens: int = opt(16, "the longest answer sampled (Dr. GRPO divides by it)")
    clip_low: float = opt(0.2, "the ratio's lower clip, 1 - this (GSPO: about 3e-4)")
    clip_high: float = opt(0.2, "the ratio's upper clip, 1 + this (DAPO's clip-higher: 0.28; GSPO: 4e-4)")
    kl_beta: float = opt(0.0, "weight of the k3 KL estimate to the reference model (0: no reference held)")
    dynamic_sampling: bool = opt(False, "DAPO's dynamic sampling: groups whose answers all score the same "
                                        "are dropped and more prompts sampled in their place")
    importance_correction: str = choice("off", "off", "tis", "mis",
                                        doc="weigh each token's policy term by w, the trainer's probability "
                                            "of it at the sampling weights over the sampler's: truncated (tis, "
                                            "min(w, cap)) or masked (mis, left out where w passes the cap)")
    importance_level: str = choice("token", "token", "sequence",
                                   doc="the correction's w per token, or one per answer (the geometric mean "
                                       "of its tokens'; gspo always)")
    importance_cap: float = opt(2.0, "the correction's cap on w; a ratio past it either way counts in "
                                     "rl/mismatch_past_bound")
    train_mtp: bool = opt(True, "the model's multi-token prediction depths train on the sampled answers "
                                "beside the policy (their loss weighted by model.multi_token_pred_lambda), so "
                                "their drafts follow the policy as it moves; false: left as they are")


@dataclass(frozen=True)
class TrainingConfig:
    output_dir: str = opt("output/vl_moe", "where metrics, VisualDL logs and the final model go")
    seed: int = opt(42, "seed for weights and data order")
    max_steps: int = opt(300, "optimizer steps")
    per_device_train_batch_size: int = opt(8, "packed rows per micro-batch per data-parallel rank")
    per_device_eval_batch_size: int = opt(16, "packed rows per evaluation batch")
    gradient_accumulation_steps: int = opt(1, "micro-batches per optimizer step")
    global_batch_size: int = opt(0, "rows per optimizer step over all data-parallel ranks; when set, "
                                    "gradient_accumulation_steps is derived from it (global / (per-device batch x "
                                    "data ranks)), so the same config keeps the global batch at any world size; 0 = "
                                    "per-device batch x gradient_accumulation_steps x data ranks")
    learning_rate: float = opt(3e-3, "peak learning rate")
    min_lr: float = opt(3e-4, "final learning rate of cosine / linear / wsd")
    lr_scheduler_type: str = choice("cosine", "cosine", "linear", "constant", "wsd", doc="schedule after warmup")
    warmup_steps: int = opt(20, "linear warmup steps")
    wsd_decay_ratio: float = opt(0.1, "wsd: fraction of max_steps spent decaying")
    weight_decay: float = opt(0.1, "AdamW decay (not on norms, biases, router bias)")
    adam_beta1: float = opt(0.9, "AdamW beta1")
    adam_beta2: float = opt(0.95, "AdamW beta2")
    adam_epsilon: float = opt(1e-8, "AdamW epsilon")
    max_grad_norm: float = opt(1.0, "global-norm clipping; 0 = off")
    moe_gate_lr_ratio: float = opt(1.0, "router learning rate = learning_rate x this")
    token_balance_loss: bool = opt(False, "divide the gradient by a fixed token count instead of the step's")
    token_balance_seqlen: int = opt(0, "that fixed count; 0 = max_seq_len x per_device_train_batch_size")
    loss_subbatch_seqlen: int = opt(0, "run the LM head and loss over sequence chunks of this many tokens, each "
                                       "recomputed in the backward pass, so the whole logits are never held (with "
                                       "sequence parallelism a multiple of the tensor degree); 0 = the whole "
                                       "sequence at once")
    moe_expert_matmul: str = choice("auto", "auto", "grouped", "per_expert",
                                    doc="'grouped': each expert width's experts in one kernel per projection "
                                        "(Paddle's grouped GEMM on GPUs, a padded batched matmul elsewhere); "
                                        "'per_expert': one expert after another; 'auto': grouped on GPUs "
                                        "(launch-bound with many small experts), per expert on CPUs "
                                        "(arithmetic-bound, where the padding only adds work)")
    offload_optim: bool = opt(False, "AdamW moments and float32 master weights in host memory between steps, "
                                      "brought to the device a bucket of parameters at a time for the update")
    eval_steps: int = opt(100, "evaluate every N steps and at the end; 0 = only at the end")
    save_steps: int = opt(0, "write output_dir/checkpoint-<step> every N steps (and at the end); 0 = only at the end")
    save_total_limit: int = opt(0, "keep the newest N checkpoints of the run's lineage; 0 = keep all")
    async_save: bool = opt(False, "a save stops the step only to copy the state to host memory; a thread writes the "
                                   "files (same format, completion marker last) while training goes on, and the "
                                   "checkpoint completes at the first logging step after every rank has written; a "
                                   "second save, a stop and the run's end wait for it")
    save_on_signal: bool = opt(True, "on SIGTERM or SIGINT (or the launcher gone), every rank finishes its step, "
                                      "saves a checkpoint and the run exits with code 4")
    final_model_format: str = choice("paddleformers", "paddleformers", "transformers",
                                     doc="final_model's config.json: PaddleFormers' or Hugging Face transformers' "
                                         "ERNIE-4.5-VL (same tensors; full fine-tuning only)")
    resume_from_checkpoint: str = opt("", "'auto' (the newest intact checkpoint of the newest run in output_dir, "
                                          "if any) or a checkpoint folder; empty = start fresh")
    reset_schedule_on_resume: bool = opt(False, "a warm restart: the resumed run takes the checkpoint's weights and "
                                                "optimizer states and starts the learning-rate schedule afresh "
                                                "(warmup, then the decay to max_steps) at the resumed step")
    overwrite_output_dir: bool = opt(False, "let a fresh run remove the checkpoints (checkpoint-<step>) an earlier "
                                            "run left in output_dir and replace its final model at the end (without "
                                            "it, such a run stops); never the model the run starts from")
    max_eval_batches: int = opt(0, "cap on evaluation batches; 0 = the whole held-out set")
    eval_generate: bool = opt(False, "at every evaluation also answer the held-out samples greedily (each sample's "
                                     "last trained span is the answer, what precedes it the prompt) and score the "
                                     "answers: eval_generate_exact_match, eval_generate_token_f1 and, on data that "
                                     "scores caption words, eval_generate_caption_accuracy")
    eval_generate_samples: int = opt(0, "held-out samples answered at each evaluation; 0 = all of them")
    eval_generate_max_new_tokens: int = opt(64, "the longest answer generated")
    rewards: list[str] = opt([], "rewards a program can check, scored on every answer of the evaluation by "
                                 "generation (eval_generate_reward_<name>, and their weighted sum "
                                 "eval_generate_reward) and, in the grpo stage, on every sampled answer: "
                                 "exact_match, containment, word_accuracy, numeric, think_format, regex "
                                 "(training.reward_pattern), or 'module:function' (answer, reference) -> float, your "
                                 "own Python code, run by the trainer")
    reward_weights: list[float] = opt([], "one weight per reward in the sum; empty = 1 each")
    reward_pattern: str = opt("", "the regular expression the 'regex' reward searches the answer for")
    eval_benchmarks: list[str] = opt([], "benchmark files answered greedily at every evaluation, each 'KIND:FILE' "
                                         "(KIND: mcq, mmbench, mmmu, chartqa, docvqa, infovqa, ocrbench, text_mcq; "
                                         "python -m ernie_moe.evaluate's formats, prompts and scores), each data rank "
                                         "answering its share: eval_bench/<file's stem> and "
                                         "eval_bench/<stem>/category/<name>")
    save_best_metric: str = opt("", "an evaluation figure (eval_loss, eval_caption_accuracy, "
                                    "eval_generate_exact_match, eval_bench/<stem>, ema_eval_loss, ...): each "
                                    "evaluation that improves it "
                                    "writes output_dir/best_model (lower is better for a name ending in 'loss', "
                                    "higher otherwise); empty = off")
    early_stopping_patience: int = opt(0, "stop the run after this many evaluations in a row without an improvement "
                                          "of save_best_metric (the final model is written as at the end); 0 = "
                                          "never")
    bf16: bool = opt(False, "mixed precision in bfloat16")
    fp16: bool = opt(False, "mixed precision in float16, with dynamic loss scaling")
    fp16_opt_level: str = choice("O2", "O1", "O2", doc="O1: float32 weights, low-precision matmuls under autocast; "
                                                       "O2: low-precision weights with float32 master weights")
    amp_master_grad: bool = opt(True, "O2: keep gradients of low-precision weights in float32")
    scale_loss: float = opt(32768.0, "fp16: initial loss scale")
    scale_incr_every: int = opt(1000, "fp16: double the loss scale after this many finite steps in a row")
    max_skipped_steps: int = opt(10, "stop after this many steps in a row skipped for inf/nan gradients; 0 = never "
                                     "(a run that skips more than half of its steps fails at the end all the same)")
    device_memory_gb: float = opt(0.0, "device memory the layout is checked against at start-up (memory planner); "
                                       "0 = the GPU's own, or the machine's RAM on a CPU")
    memory_guard_fraction: float = opt(0.85, "when a step's memory peak passes this fraction of the device, "
                                            "tighten the experts' capacity (memory_guard_capacity), recompute "
                                            "more, then halve the micro-batch; 0 = off")
    memory_guard_capacity: float = opt(0.0, "the guard's first rung: the routed experts' training capacity factor "
                                            "for memory_guard_capacity_steps steps (tokens over it are dropped "
                                            "and counted); 0 = no such rung")
    memory_guard_capacity_steps: int = opt(20, "steps the capacity rung holds before the configured capacity "
                                               "returns")
    ema_decay: float = opt(0.0, "keep an exponential moving average of the trained weights in float32 "
                                "(ema = decay x ema + (1 - decay) x weights), split over the data-parallel replicas "
                                "and evaluated beside the model; 0 = off")
    ema_start_step: int = opt(0, "the EMA starts as a copy of the weights after the first step at or past this one")
    ema_update_every: int = opt(1, "update the EMA every N steps after its start")
    save_ema_as_final: bool = opt(False, "final_model holds the EMA weights instead of the trained ones")
    replica_check: str = choice("stop", "stop", "warn", "off",
                                doc="compare the weights every data-parallel (and expert) replica should hold "
                                    "equal, at the start, after a resume and every replica_check_steps: a mismatch "
                                    "stops the run or warns")
    replica_check_steps: int = opt(0, "also check the replicas every N steps; 0 = at the start and after a resume "
                                      "only")
    recompute: bool = opt(False, "drop activations after the forward pass and recompute them in backward")
    recompute_granularity: str = choice("full", "full", "full_attn", "core_attn", "moe",
                                        doc="what recomputes: the whole decoder layer, the attention block, the "
                                            "attention core, or the MoE block")
    recompute_layers: int | list[int] = opt(0, "decoder layers that recompute: 0 = all, N = the first N, or a list")
    recompute_use_reentrant: bool = opt(True, "fleet recompute as a PyLayer (true) or through saved-tensor hooks "
                                              "(false: on Paddle 3.3 it does not lower the peak)")
    fine_tuning: str = choice("full", "full", "lora", doc="what trains: every weight, or LoRA pairs beside the "
                                                         "lora_targets linears with the base weights frozen")
    lora_rank: int = opt(8, "LoRA: rank r of each pair (A [in, r], B [r, out])")
    lora_alpha: float = opt(16.0, "LoRA: the pair's output is scaled by lora_alpha / r")
    rslora: bool = opt(False, "LoRA: scale by lora_alpha / sqrt(r) (rank-stabilised LoRA)")
    lora_dropout: float = opt(0.0, "LoRA: dropout on the pair's input")
    lora_targets: list[str] = opt(["attention", "mlp", "shared_experts", "text_experts", "vision_experts"],
                                  "LoRA: groups (attention, mlp, shared_experts, text_experts, vision_experts, "
                                  "vit, adapter, mtp: the multi-token prediction layers' linears) or regular "
                                  "expressions matched in full against layer names (model.layers.1.self_attn.qkv_proj)")
    freeze: list[str] = opt([], "parts that do not train: vision, adapter, lm, embedding, head, router, mtp "
                                "(ERNIEKit's freeze_vision = [vision]; [vision, adapter, lm] trains the "
                                "multi-token prediction layers alone, PaddleFormers' train_mtp_only)")
    quantize_base: str = choice("", "", "wint8", "wint4",
                                doc="LoRA: hold the frozen base linears of the language model (attention, dense MLP, "
                                    "shared and routed experts) in int8, or int4 packed two to a byte, with scales "
                                    "per output column (ERNIEKit's compute_type wint8 / wint4); empty = as loaded")
    quantize_group_size: int = opt(0, "wint4: one scale per output column and group of this many input rows; 0 = "
                                      "one per output column")
    vit_lr_ratio: float = opt(1.0, "ViT learning rate = learning_rate x this")
    visual_ld: float = opt(1.0, "layer-wise decay of the ViT learning rate: block i of D gets visual_ld^(D-i)")
    model_name_or_path: str = opt("", "start from this ERNIE 4.5 checkpoint folder (PaddleFormers, ERNIE Paddle or "
                                      "PaddleNLP form); its config.json gives the model's architecture (see "
                                      "above); empty = random weights")
    mtp_init: str = choice("scratch", "scratch", "last_layer",
                           doc="multi-token prediction layers that model_name_or_path lacks: drawn at random, or "
                               "each depth's attention and norms copied from the last decoder layer and its MLP from "
                               "the last dense layer (the projection and its two norms start as drawn); full runs "
                               "only: a LoRA adapter could not be loaded over depths its base lacks")
    stage: str = field(default="sft", metadata={"choices": STAGES, "doc": (
        "what the run learns from: supervised answers, preference pairs (a prompt with a chosen and a rejected "
        "answer; see training.dpo), or answers the model samples to prompts, scored by training.rewards "
        "(reinforcement learning; see training.rl)")})
    dpo: PreferenceConfig = field(default_factory=PreferenceConfig,
                                  metadata={"doc": "training.stage dpo's settings (also read as training.dpo_<key>)"})
    rl: PolicyConfig = field(default_factory=PolicyConfig,
                             metadata={"doc": "training.stage grpo's settings (also read as training.rl_<key>)"})
    router_replay: str = choice("rollout", "rollout", "old_policy", "off",
                                doc="grpo: the experts each token went to when it was sampled are imposed in the "
                                    "update (rollout), so the ratio measures the policy and not routing flips "
                                    "(capacity, a moved correction bias); old_policy: the routing and "
                                    "log-probabilities of a forward of the sampling weights, in the run's layout, "
                                    "before the updates (one more forward per rollout); off: the update routes "
                                    "afresh")


@dataclass(frozen=True)
class ParallelConfig:
    # The data-parallel degree is what the other degrees leave of the launched processes:
    # world = data x pipeline x sharding x tensor. Expert groups come out of the data x sharding ranks
    # (moe_group 'ep') or are the tensor-parallel ranks (moe_group 'mp').
    tensor_parallel_degree: int = opt(1, "tensor-parallel ranks: attention heads, MLP width and vocabulary are split")
    pipeline_parallel_degree: int = opt(1, "pipeline stages (fleet's PipelineLayer and 1F1B schedule); "
                                           "micro-batches = training.gradient_accumulation_steps")
    virtual_pp_degree: int = opt(1, "model chunks per pipeline rank (fleet's interleaved schedule)")
    sharding_parallel_degree: int = opt(1, "ranks the optimizer states (stage2: the gradients, stage3: the weights "
                                           "too) are split over (ZeRO); needs 'sharding'")
    sharding: str = choice("", "", "stage1", "stage2", "stage3",
                           doc="sharding stage: stage1 splits the optimizer states, stage2 the gradients too, "
                               "stage3 the weights too")
    expert_parallel_degree: int = opt(1, "ranks each modality's experts are split over, with moe_group 'ep'")
    moe_group: str = choice("ep", "ep", "mp", doc="expert ranks: 'ep' from the data x sharding ranks, "
                                                  "'mp' the tensor-parallel ranks (experts not split)")
    sequence_parallel: bool = opt(False, "split activations along the sequence between tensor-parallel regions")
    overlap_grad_sync: bool = opt(True, "average gradients over the data ranks bucket by bucket during the backward "
                                        "pass (fleet's reducer) instead of after it; not with a pipeline")


@dataclass(frozen=True)
class LoggingConfig:
    logging_steps: int = opt(10, "log every N optimizer steps")
    visualdl: bool = opt(True, "VisualDL scalars, images, text in output_dir/visualdl (a run per rank for memory)")
    progress_bar: bool = opt(True, "tqdm progress bar on rank 0")
    monitor: bool = opt(True, "expert-balance, memory and FLOPs metrics (off: losses, lr, speed only)")
    time_breakdown: bool = opt(True, "time/... metrics: where each step's time goes (data, forward, backward, "
                                     "collectives, gradient sync, optimizer)")
    count_host_reads: bool = opt(False, "count the device-to-host reads of the training steps (after the run's "
                                        "first) into summary.json's host_reads, each rank's by reason "
                                        "(ernie_moe.host_reads.DECLARED) and any other by the line that made it")
    imbalance_warn_ratio: float = opt(1.15, "warn when a layer's max/mean expert load stays above this")
    imbalance_warn_windows: int = opt(5, "... for this many logging windows in a row")
    memory_warn_fraction: float = opt(0.9, "warn when a rank's peak memory passes this fraction of the device")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
