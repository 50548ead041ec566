"""Cross-field checks: values that are each well typed but cannot work together."""

from __future__ import annotations

import glob
import math
import re
from pathlib import Path

from ..paths import not_a_file
from .errors import ConfigError, collecting, raise_all, report
from .schema import (
    BENCHMARK_KINDS,
    FREEZE_PARTS,
    LORA_TARGET_GROUPS,
    MTP_MAX_DEPTH,
    TOKENIZER_FILES,
    Config,
    ModelConfig,
    TrainingConfig,
)
from .transformers_form import to_transformers


def mtp_trains(training_cfg: TrainingConfig) -> bool:
    """Whether the run may update the multi-token prediction layers: not frozen (LoRA: among its targets)."""
    t = training_cfg
    return "mtp" in t.lora_targets if t.fine_tuning == "lora" else "mtp" not in t.freeze


def validate(cfg: Config, check_paths: bool = True) -> None:
    """``check_paths=False`` skips the checks that data and tokenizer files exist (planning a run elsewhere).
    One ConfigError names every problem found."""
    raise_all(problems_of(cfg, check_paths))


def problems_of(cfg: Config, check_paths: bool = True) -> list[str]:
    """Every problem of ``cfg``, each section's checks going on past one (see :func:`errors.collecting`)."""
    problems: list[str] = []
    for check in (lambda: check_model(cfg.model), lambda: _check_data(cfg, check_paths),
                  lambda: _check_training(cfg, check_paths), lambda: _check_parallel(cfg),
                  lambda: _check_final_format(cfg), lambda: _check_logging(cfg)):
        with collecting(problems):
            check()
    return problems


def _check_logging(cfg: Config) -> None:
    lg = cfg.logging
    _require(lg.logging_steps >= 1 and lg.imbalance_warn_windows >= 1,
             "logging.logging_steps and logging.imbalance_warn_windows must be at least 1.")
    _require(lg.imbalance_warn_ratio >= 1.0, "logging.imbalance_warn_ratio must be at least 1 (1 = perfect balance).")
    _require(0 < lg.memory_warn_fraction <= 1, "logging.memory_warn_fraction must be in (0, 1].")


# Far above any published model (ERNIE 4.5: 103,424 tokens, rows of up to 131,072); past them a value is a typo,
# and building from it would allocate (or pack rows) without end before anything else could say so.
MAX_VOCAB_SIZE = 2 ** 31 - 1  # token ids are int32 in the embedding's lookup
MAX_SEQ_LEN = 1 << 22


def _require(ok: bool, message: str) -> None:
    if not ok:
        report(message)


def check_model(m: ModelConfig) -> None:
    """The model section's own cross-field checks (also what a model folder's config.json must pass to be
    exported)."""
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "moe_k", "moe_layer_interval"):
        _require(getattr(m, name) >= 1, f"model.{name} must be at least 1, got {getattr(m, name)}.")
    _require(m.vocab_size <= MAX_VOCAB_SIZE, f"model.vocab_size ({m.vocab_size}) is above {MAX_VOCAB_SIZE:,}, the "
                                             "most token ids an embedding can look up.")
    _require(m.num_attention_heads % m.num_key_value_heads == 0,
             f"model.num_attention_heads ({m.num_attention_heads}) must be a multiple of model.num_key_value_heads "
             f"({m.num_key_value_heads}) for grouped-query attention.")
    _require(m.head_dim % 2 == 0, f"model.head_dim ({m.head_dim}) must be even for rotary embeddings.")
    if m.rope_3d:
        half = m.head_dim // 2
        _require(0 < m.freq_allocation < half and (half - m.freq_allocation) % 2 == 0,
                 f"model.freq_allocation ({m.freq_allocation}) must be between 1 and head_dim/2 - 1 ({half - 1}) and "
                 f"leave an even number of slots for the h and w axes.")
    for name in ("initializer_range", "rms_norm_eps", "rope_theta"):
        _require(getattr(m, name) > 0, f"model.{name} must be positive, got {getattr(m, name)}.")
    _require(0 <= m.num_nextn_predict_layers <= MTP_MAX_DEPTH and m.multi_token_pred_lambda >= 0,
             f"model.num_nextn_predict_layers ({m.num_nextn_predict_layers}) must be in 0..{MTP_MAX_DEPTH} and "
             f"model.multi_token_pred_lambda ({m.multi_token_pred_lambda}) not negative.")
    _require(0 <= m.im_patch_id < m.vocab_size,
             f"model.im_patch_id ({m.im_patch_id}) must be a token id below vocab_size.")

    groups = len(m.moe_num_experts)
    _require(groups in (0, 1, 2),
             f"model.moe_num_experts must list 1 or 2 counts ([text, vision]), or be [] for a dense model; got "
             f"{m.moe_num_experts}.")
    _require(len(m.moe_intermediate_size) == groups,
             f"model.moe_intermediate_size {m.moe_intermediate_size} must have one width per entry of "
             f"model.moe_num_experts {m.moe_num_experts}.")
    _require(all(n >= 1 for n in m.moe_num_experts + m.moe_intermediate_size),
             "model.moe_num_experts and model.moe_intermediate_size entries must be at least 1.")
    if groups:
        smallest = min(m.moe_num_experts) if m.moe_use_hard_gate else sum(m.moe_num_experts)
        _require(m.moe_k <= smallest,
                 f"model.moe_k ({m.moe_k}) is larger than a modality's expert count {m.moe_num_experts}; "
                 f"lower moe_k or add experts.")
    _require(m.moe_num_shared_experts >= 0, "model.moe_num_shared_experts cannot be negative.")
    _require(len(m.moe_capacity) in (0, 3) and all(c > 0 for c in m.moe_capacity),
             f"model.moe_capacity must be [] (dropless) or three positive factors [train, eval, eval_small], "
             f"got {m.moe_capacity}.")
    _require(m.moe_aux_free_update_coef >= 0, "model.moe_aux_free_update_coef cannot be negative.")
    for name in ("moe_aux_loss_lambda", "moe_z_loss_lambda", "moe_orthogonal_loss_lambda", "moe_layer_start_index",
                 "moe_layer_end_index"):
        value = getattr(m, name)
        if isinstance(value, list):
            _require(len(value) == groups, f"model.{name} {value} must have one value per modality ({groups}), or "
                                           f"be one number for all.")

    layers = m.num_hidden_layers
    moe_depths = [k for k in range(min(m.num_nextn_predict_layers, layers, MTP_MAX_DEPTH))
                  if m.moe_modalities_at(k)]
    _require(not moe_depths,
             f"model.num_nextn_predict_layers {m.num_nextn_predict_layers}: PaddleFormers builds MTP depth k as "
             f"decoder layer k, and layer(s) {moe_depths} are MoE layers here (moe_layer_start_index "
             f"{m.moe_layer_start_index}); this package trains dense MTP layers: start the MoE layers at "
             f"{m.num_nextn_predict_layers} or later, or set num_nextn_predict_layers to 0 to leave MTP out.")
    starts, ends = m.moe_layer_range()
    for start, end in zip(starts, ends):
        _require(0 <= start < layers and 0 <= end < layers and start <= end,
                 f"MoE layer range start={m.moe_layer_start_index} end={m.moe_layer_end_index} lies outside the "
                 f"model's {layers} layers (valid indices 0..{layers - 1}, end -1 = last layer).")
    if len(set(zip(starts, ends))) > 1:
        _require(m.moe_num_shared_experts > 0,
                 "per-modality MoE layer ranges leave some layers without experts for one modality; those tokens "
                 "use the shared experts, so model.moe_num_shared_experts must be at least 1.")

    v = m.vision_config
    _require(v.depth >= 1 and v.embed_dim >= 1 and v.num_heads >= 1 and v.patch_size >= 1 and v.spatial_merge_size >= 1,
             "model.vision_config depth, embed_dim, num_heads, patch_size and spatial_merge_size must be at least 1.")
    for name in ("mlp_ratio", "rope_theta"):
        _require(getattr(v, name) > 0, f"model.vision_config.{name} must be positive, got {getattr(v, name)}.")
    _require(v.in_channels == 3, f"model.vision_config.in_channels is {v.in_channels}, but images reach the model as "
                                 "RGB (3 channels): set it to 3.")
    _require(v.embed_dim % v.num_heads == 0 and (v.embed_dim // v.num_heads) % 4 == 0,
             f"model.vision_config.embed_dim ({v.embed_dim}) / num_heads ({v.num_heads}) must be a multiple of 4 "
             f"(2D rotary positions split each head between the h and w axes).")
    _require(m.pixel_hidden_size == v.embed_dim,
             f"model.pixel_hidden_size ({m.pixel_hidden_size}) must equal model.vision_config.embed_dim "
             f"({v.embed_dim}).")
    _require(m.spatial_conv_size == v.spatial_merge_size,
             f"model.spatial_conv_size ({m.spatial_conv_size}) must equal model.vision_config.spatial_merge_size "
             f"({v.spatial_merge_size}).")
    _require(m.temporal_conv_size in (1, 2), "model.temporal_conv_size must be 1 or 2.")


def _check_data(cfg: Config, check_paths: bool = True) -> None:
    d, v = cfg.data, cfg.model.vision_config
    _require(d.max_seq_len >= 8, f"data.max_seq_len ({d.max_seq_len}) must be at least 8.")
    _require(d.max_seq_len <= MAX_SEQ_LEN, f"data.max_seq_len ({d.max_seq_len}) is above {MAX_SEQ_LEN:,}, the most "
                                           "tokens a packed row may hold here.")
    _require(d.max_seq_len <= cfg.model.max_position_embeddings,
             f"data.max_seq_len ({d.max_seq_len}) exceeds model.max_position_embeddings "
             f"({cfg.model.max_position_embeddings}).")
    _require(d.max_image_side > 0 or d.image_max_pixels > 0,
             "data.image_max_pixels is 0 and data.max_image_side too: images need a rule, a pixel budget "
             "(data.image_max_pixels, for example 200704) or a longest side (data.max_image_side).")
    if d.pixel_budget and d.image_max_pixels:
        unit_area = (v.patch_size * v.spatial_merge_size) ** 2
        for kind in ("image", "video"):
            low, high = getattr(d, f"{kind}_min_pixels"), getattr(d, f"{kind}_max_pixels")
            _require(unit_area <= low <= high, f"data.{kind}_min_pixels ({low}) must be at least {unit_area} (one "
                                               f"merge block) and at most data.{kind}_max_pixels ({high}).")
    _require(d.video_fps > 0 and 1 <= d.video_min_frames <= d.video_max_frames,
             f"data.video_fps ({d.video_fps}) must be positive and 1 <= data.video_min_frames ({d.video_min_frames}) "
             f"<= data.video_max_frames ({d.video_max_frames}).")
    _require(0 <= d.num_workers <= 64, f"data.num_workers ({d.num_workers}) must be between 0 and 64.")
    _require(0 <= d.read_ahead_steps <= 64, f"data.read_ahead_steps ({d.read_ahead_steps}) must be between 0 and 64.")
    _require(0 <= d.report_samples <= 100_000, f"data.report_samples ({d.report_samples}) must be between 0 and "
                                               "100000.")
    unit = v.patch_size * v.spatial_merge_size
    if d.dataset == "synthetic":
        _require(d.image_size % unit == 0 and d.image_size >= 2 * unit,
                 f"data.image_size ({d.image_size}) must be a multiple of patch_size x spatial_merge_size ({unit}) "
                 f"and at least {2 * unit}.")
        _require(d.num_train_samples >= 1 and d.num_eval_samples >= 0,
                 "data.num_train_samples must be at least 1 and data.num_eval_samples not negative.")
    else:
        files, texts = d.train_files, d.text_files
        _require(bool(files) and all(files), "data.dataset is 'jsonl' but data.train_path is empty.")
        _require(all(texts), "data.text_path holds an empty file name.")
        for name, path in ([("train_path", f) for f in files] + [("text_path", f) for f in texts]
                           + [("eval_path", d.eval_path)]):
            # a folder of shards or a glob is opened, and judged, when the data is built
            shards = bool(path) and (Path(path).is_dir() or glob.has_magic(path))
            problem = not_a_file(path) if check_paths and path and not shards else None
            _require(problem is None, f"data.{name} '{path}' {problem}.")
        for key, probs, paths in (("train", d.train_probs, files), ("text", d.text_probs, texts)):
            if probs:
                _require(len(probs) == len(paths) and all(p >= 0 for p in probs),
                         f"data.{key}_probs ({probs}) needs one probability (not negative) for each of the "
                         f"{len(paths)} data.{key}_path files.")
                _require(abs(sum(probs) - 1) <= 1e-6, f"data.{key}_probs ({probs}) must sum to 1, not "
                                                      f"{sum(probs):g}.")
        _require(len(d.modality_ratio) == 2 and min(d.modality_ratio) >= 0 and sum(d.modality_ratio) > 0,
                 f"data.modality_ratio ({d.modality_ratio}) needs two weights (train_path files, text_path files), "
                 "neither negative, not both 0.")
        _require(d.max_image_side == 0 or d.max_image_side >= unit,
                 f"data.max_image_side must be 0 (the pixel budget) or at least {unit} pixels.")
        _require(d.max_image_pixels >= unit * unit, f"data.max_image_pixels must be at least {unit * unit}.")
    if d.index_dir and check_paths:
        _require(not Path(d.index_dir).exists() or Path(d.index_dir).is_dir(),
                 f"data.index_dir '{d.index_dir}' is not a folder: the length index and line offsets are kept in "
                 "files under it; name a folder (it is made when missing).")
    if d.tokenizer_path and check_paths:
        _require(any((Path(d.tokenizer_path) / name).is_file() for name in TOKENIZER_FILES),
                 f"data.tokenizer_path '{d.tokenizer_path}' holds no tokenizer ({', '.join(TOKENIZER_FILES)}).")
    if d.video_timestamp_font and check_paths:
        _require(_is_font(d.video_timestamp_font),
                 f"data.video_timestamp_font '{d.video_timestamp_font}' is not a TrueType font file.")


def _is_font(path: str) -> bool:
    from PIL import ImageFont

    try:
        ImageFont.truetype(path, 10)
    except (OSError, ValueError):
        return False
    return True


def _check_rewards(t) -> None:
    _require(not t.reward_weights or len(t.reward_weights) == len(t.rewards),
             f"training.reward_weights has {len(t.reward_weights)} weight(s) for {len(t.rewards)} reward(s): give one "
             "per reward, or none (1 each).")
    _require(not t.rewards or t.eval_generate or t.stage == "grpo",
             "training.rewards are scored on the answers of the evaluation by generation: set "
             "training.eval_generate=true.")
    if "regex" in t.rewards:
        _require(bool(t.reward_pattern), "training.rewards names 'regex': set training.reward_pattern.")
        try:
            re.compile(t.reward_pattern)
        except re.error as err:
            raise ConfigError(f"training.reward_pattern {t.reward_pattern!r} is not a regular expression: {err}.") \
                from None


def _check_training(cfg: Config, check_paths: bool = True) -> None:
    t = cfg.training
    _check_rewards(t)
    _require(0 <= t.seed < 2 ** 32, f"training.seed ({t.seed}) must be between 0 and 2**32 - 1.")
    _require(t.adam_epsilon > 0, f"training.adam_epsilon must be positive, got {t.adam_epsilon}.")
    for name in ("save_steps", "save_total_limit", "device_memory_gb", "loss_subbatch_seqlen", "global_batch_size"):
        _require(getattr(t, name) >= 0, f"training.{name} cannot be negative, got {getattr(t, name)}.")
    # far above any device, so that the size in bytes stays a number
    _require(t.device_memory_gb <= 1e6, f"training.device_memory_gb ({t.device_memory_gb:g}) must be at most 1e6.")
    _check_output_dir(t.output_dir)
    _require(not (t.bf16 and t.fp16), "training.bf16 and training.fp16 are both set; choose one.")
    _require(0 <= t.memory_guard_fraction <= 1, "training.memory_guard_fraction must be in [0, 1] (0 = off).")
    _require(t.memory_guard_capacity >= 0 and t.memory_guard_capacity_steps >= 1,
             "training.memory_guard_capacity cannot be negative (0 = no capacity rung) and "
             "training.memory_guard_capacity_steps must be at least 1.")
    _require(0 <= t.ema_decay < 1, f"training.ema_decay ({t.ema_decay}) must be in [0, 1) (0 = no EMA).")
    _require(t.ema_start_step >= 0 and t.ema_update_every >= 1 and t.replica_check_steps >= 0,
             "training.ema_start_step and replica_check_steps cannot be negative, training.ema_update_every must be "
             "at least 1.")
    _require(t.ema_decay > 0 or not t.save_ema_as_final,
             "training.save_ema_as_final needs an EMA: set training.ema_decay (for example 0.999).")
    _require(not t.save_ema_as_final or t.ema_start_step <= t.max_steps,
             f"training.save_ema_as_final: the EMA starts at step {t.ema_start_step} (training.ema_start_step), after "
             f"the run's last step ({t.max_steps}).")
    _require(t.scale_loss >= 1 and t.scale_incr_every >= 1 and t.max_skipped_steps >= 0,
             "training.scale_loss and training.scale_incr_every must be at least 1, training.max_skipped_steps "
             "at least 0.")
    trained_beside = t.stage == "sft" or (t.stage == "grpo" and t.rl.train_mtp)
    _require(not cfg.model.num_nextn_predict_layers or trained_beside or not mtp_trains(t),
             f"training.stage {t.stage} does not train the model's multi-token prediction layers "
             f"(model.num_nextn_predict_layers {cfg.model.num_nextn_predict_layers}): add mtp to training.freeze to "
             "keep them as loaded (with LoRA: leave mtp out of training.lora_targets), or set "
             "model.num_nextn_predict_layers to 0 to leave them out" +
             (" (or training.rl.train_mtp=true to train them on the sampled answers)." if t.stage == "grpo" else "."))
    r, layers = t.recompute_layers, cfg.model.num_hidden_layers
    if isinstance(r, list):
        _require(all(0 <= i < layers for i in r), f"training.recompute_layers {r} names layers outside the model's "
                                                   f"{layers} (valid 0..{layers - 1}).")
    else:
        _require(0 <= r <= layers, f"training.recompute_layers ({r}) must be 0 (every layer) or a count up to the "
                                   f"model's {layers} layers, or a list of layer indices.")
    for name in ("max_steps", "per_device_train_batch_size", "per_device_eval_batch_size",
                 "gradient_accumulation_steps"):
        _require(getattr(t, name) >= 1, f"training.{name} must be at least 1, got {getattr(t, name)}.")
    _require(t.learning_rate > 0 and 0 <= t.min_lr <= t.learning_rate,
             f"training.learning_rate ({t.learning_rate}) must be positive and training.min_lr ({t.min_lr}) "
             f"between 0 and it.")
    _require(t.warmup_steps >= 0, f"training.warmup_steps ({t.warmup_steps}) cannot be negative.")
    _require(0 < t.wsd_decay_ratio <= 1, "training.wsd_decay_ratio must be in (0, 1].")
    _require(0 <= t.adam_beta1 < 1 and 0 <= t.adam_beta2 < 1, "training.adam_beta1/adam_beta2 must be in [0, 1).")
    _require(t.weight_decay >= 0 and t.max_grad_norm >= 0 and t.moe_gate_lr_ratio >= 0,
             "training.weight_decay, max_grad_norm and moe_gate_lr_ratio cannot be negative.")
    _require(t.eval_steps >= 0 and t.max_eval_batches >= 0 and t.token_balance_seqlen >= 0,
             "training.eval_steps, max_eval_batches and token_balance_seqlen cannot be negative.")
    _require(t.eval_generate_samples >= 0 and t.eval_generate_max_new_tokens >= 1 and t.early_stopping_patience >= 0,
             "training.eval_generate_samples and early_stopping_patience cannot be negative, "
             "training.eval_generate_max_new_tokens must be at least 1.")
    for spec in t.eval_benchmarks:
        kind, sep, path = spec.partition(":")
        _require(bool(sep) and kind in BENCHMARK_KINDS, f"training.eval_benchmarks entry '{spec}' must be KIND:FILE, "
                                                        f"KIND one of {', '.join(BENCHMARK_KINDS)}.")
        folder_or_glob = Path(path).is_dir() or any(c in path for c in "*?[")
        problem = not_a_file(path) if check_paths and sep and not folder_or_glob else None
        _require(problem is None, f"training.eval_benchmarks file '{path}' {problem}.")
    _require(not t.save_best_metric or t.save_best_metric.startswith(("eval_", "ema_eval_")),
             f"training.save_best_metric {t.save_best_metric!r} is not an evaluation figure: name one of the eval_* "
             "(or ema_eval_*) figures in metrics.jsonl, for example eval_loss.")
    _require(not t.early_stopping_patience or bool(t.save_best_metric),
             "training.early_stopping_patience counts evaluations without an improvement of training.save_best_metric:"
             " set it too (for example eval_loss).")
    p = cfg.parallel
    whole_model = p.tensor_parallel_degree == 1 and p.pipeline_parallel_degree == 1 and \
        p.expert_parallel_degree == 1 and p.sharding != "stage3"
    _require(not t.eval_generate or whole_model,
             "training.eval_generate decodes on each data-parallel rank with the whole model; it does not run with "
             "tensor, pipeline or expert parallelism or sharding stage 3 (their ranks would have to decode in step): "
             "evaluate final_model with python -m ernie_moe.generate instead.")
    _require(not t.eval_benchmarks or whole_model,
             "training.eval_benchmarks answers on each data-parallel rank with the whole model; it does not run with "
             "tensor, pipeline or expert parallelism or sharding stage 3 (their ranks would have to decode in step): "
             "score final_model with python -m ernie_moe.evaluate --benchmark instead.")
    _check_fine_tuning(t)
    _check_preference(cfg)
    _check_rl(cfg)


def _check_preference(cfg: Config) -> None:
    t = cfg.training
    if t.stage != "dpo":
        return
    _require(t.dpo.beta > 0, f"training.dpo.beta must be positive, got {t.dpo.beta}.")
    _require(0 <= t.dpo.label_smoothing < 0.5, f"training.dpo.label_smoothing must be in [0, 0.5), got "
                                               f"{t.dpo.label_smoothing}.")
    _require(t.dpo.dpop_lambda >= 0 and t.dpo.sft_weight >= 0,
             "training.dpo.dpop_lambda and training.dpo.sft_weight cannot be negative.")
    _require(not t.eval_generate, "training.eval_generate scores answers to prompts; a preference run evaluates its "
                                  "held-out pairs (eval_reward_accuracy): set training.eval_generate=false.")
    _require(not t.token_balance_loss, "training.token_balance_loss divides by tokens; a preference run's loss is "
                                       "a mean over pairs: set training.token_balance_loss=false.")


def _check_rl(cfg: Config) -> None:
    t, p = cfg.training, cfg.parallel
    if t.stage != "grpo":
        return
    _require(bool(t.rewards), "training.stage grpo learns from rewards: name at least one in training.rewards (for "
                              "example word_accuracy, exact_match, or your module:function).")
    _require(t.rl.group_size >= 2, f"training.rl.group_size ({t.rl.group_size}) must be at least 2: advantages "
                                   "compare the answers of a group.")
    rows = t.per_device_train_batch_size * t.gradient_accumulation_steps
    _require(t.rl.updates_per_rollout >= 1 and rows % t.rl.group_size == 0,
             f"training.rl.updates_per_rollout must be at least 1, and a step's rows on each data rank "
             f"(per_device_train_batch_size x gradient_accumulation_steps = {rows}) whole groups of "
             f"training.rl.group_size ({t.rl.group_size}).")
    _require(t.rl.temperature > 0 and 0 < t.rl.top_p <= 1,
             f"training.rl.temperature ({t.rl.temperature}) must be positive and training.rl.top_p ({t.rl.top_p}) in "
             "(0, 1].")
    _require(1 <= t.rl.max_new_tokens < cfg.data.max_seq_len,
             f"training.rl.max_new_tokens ({t.rl.max_new_tokens}) must be at least 1 and leave room for a prompt in "
             f"data.max_seq_len ({cfg.data.max_seq_len}).")
    _require(0 <= t.rl.clip_low < 1 and t.rl.clip_high >= 0 and t.rl.kl_beta >= 0,
             "training.rl.clip_low must be in [0, 1), training.rl.clip_high and training.rl.kl_beta cannot be "
             "negative.")
    _require(math.isfinite(t.rl.importance_cap) and t.rl.importance_cap > 1,
             f"training.rl.importance_cap ({t.rl.importance_cap}) must be a finite number above 1.")
    _require(t.rl.importance_correction == "off" or t.rl.updates_per_rollout == 1 or t.router_replay == "old_policy",
             f"training.rl.importance_correction {t.rl.importance_correction} weighs the trainer's probabilities at "
             f"the sampling weights against the sampler's: with rl.updates_per_rollout "
             f"{t.rl.updates_per_rollout} the later updates' forwards are no longer at those weights; set "
             "training.router_replay=old_policy (a forward of the sampling weights before the updates) or "
             "rl.updates_per_rollout=1.")
    _require(p.virtual_pp_degree <= 1 and not p.sequence_parallel,
             "training.stage grpo samples its answers one token at a time through the model's stages: it runs with "
             "data, tensor, pipeline and expert parallelism and sharding, not with interleaved pipeline stages "
             "(parallel.virtual_pp_degree) or sequence parallelism (a new token's sequence cannot be split).")
    _require(not t.token_balance_loss, "training.token_balance_loss divides by tokens; the GRPO family's losses are "
                                       "normalised as training.rl.loss says: set training.token_balance_loss=false.")


def _check_fine_tuning(t) -> None:
    _require(not t.quantize_base or t.fine_tuning == "lora",
             f"training.quantize_base: {t.quantize_base} holds a frozen base in low precision: it needs "
             "training.fine_tuning: lora (a base that trains cannot be held quantised).")
    _require(t.quantize_group_size >= 0 and t.quantize_group_size % 2 == 0,
             f"training.quantize_group_size ({t.quantize_group_size}) must be an even number of input rows, or 0 "
             "(one scale per output column).")
    unknown = [p for p in t.freeze if p not in FREEZE_PARTS]
    _require(not unknown, f"training.freeze names unknown parts {unknown}; choose from {', '.join(FREEZE_PARTS)}.")
    _require(t.vit_lr_ratio > 0 and 0 < t.visual_ld <= 1,
             f"training.vit_lr_ratio ({t.vit_lr_ratio}) must be positive and training.visual_ld ({t.visual_ld}) "
             "in (0, 1].")
    if t.fine_tuning != "lora":
        return
    _require(t.lora_rank >= 1, f"training.lora_rank must be at least 1, got {t.lora_rank}.")
    _require(t.lora_alpha > 0, f"training.lora_alpha must be positive, got {t.lora_alpha}.")
    _require(0 <= t.lora_dropout < 1, f"training.lora_dropout must be in [0, 1), got {t.lora_dropout}.")
    _require(bool(t.lora_targets), "training.lora_targets is empty: LoRA needs at least one target.")
    for target in t.lora_targets:
        if target not in LORA_TARGET_GROUPS:
            try:
                re.compile(target)
            except re.error as err:
                raise ConfigError(f"training.lora_targets: {target!r} is neither a group "
                                  f"({', '.join(LORA_TARGET_GROUPS)}) nor a regular expression: {err}") from None
    _require(bool(t.model_name_or_path),
             "training.fine_tuning 'lora' adapts a pretrained model: set training.model_name_or_path to its folder "
             "(the adapter's checkpoints hold only the LoRA pairs and refer to that folder).")


def _check_final_format(cfg: Config) -> None:
    if cfg.training.final_model_format != "transformers":
        return
    _require(cfg.training.fine_tuning != "lora",
             "training.final_model_format 'transformers' writes a whole model; a LoRA run writes its adapter in "
             "PaddleFormers' form: merge it with python -m ernie_moe.export ADAPTER OUT --merge-lora --format "
             "transformers.")
    _require(not cfg.data.max_image_side,
             f"training.final_model_format 'transformers': data.max_image_side ({cfg.data.max_image_side}) resizes "
             "images by their longest side, which transformers' image processor cannot reproduce: use the pixel "
             "budget (data.max_image_side 0, data.image_max_pixels).")
    try:
        to_transformers(cfg.model, {})
    except ValueError as err:
        raise ConfigError(f"training.final_model_format 'transformers': {err}.") from None


def _check_output_dir(output_dir: str) -> None:
    _require(bool(output_dir.strip()), "training.output_dir is empty.")
    for folder in [Path(output_dir), *Path(output_dir).parents]:
        if folder.exists():
            _require(folder.is_dir(), f"training.output_dir '{output_dir}' cannot be created: '{folder}' is a file.")
            return


def _check_parallel(cfg: Config) -> None:
    """Layout rules that need no process count; ``parallel.env.check_layout`` adds the world-size ones."""
    p, m = cfg.parallel, cfg.model
    degrees = {
        "tensor_parallel_degree": p.tensor_parallel_degree,
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
        "virtual_pp_degree": p.virtual_pp_degree,
        "sharding_parallel_degree": p.sharding_parallel_degree,
        "expert_parallel_degree": p.expert_parallel_degree,
    }
    for name, value in degrees.items():
        _require(value >= 1, f"parallel.{name} must be at least 1, got {value}.")
    pp, vpp = p.pipeline_parallel_degree, p.virtual_pp_degree
    _require(vpp == 1 or pp > 1, f"parallel.virtual_pp_degree ({vpp}) interleaves pipeline stages; it needs "
                                 "parallel.pipeline_parallel_degree > 1 (or set it to 1).")
    _require(m.num_hidden_layers % (pp * vpp) == 0,
             f"model.num_hidden_layers ({m.num_hidden_layers}) must be divisible by pipeline_parallel_degree x "
             f"virtual_pp_degree ({pp} x {vpp}): every stage gets the same number of decoder layers.")
    gas = cfg.training.gradient_accumulation_steps
    _require(pp == 1 or gas >= pp,
             f"training.gradient_accumulation_steps ({gas}) is the pipeline's number of micro-batches; with fewer "
             f"than pipeline_parallel_degree ({pp}) stages sit idle most of the step: raise it to at least {pp}.")
    _require(vpp == 1 or pp >= 3, f"parallel.virtual_pp_degree ({vpp}): fleet's interleaved schedule needs at "
                                  f"least 3 pipeline stages, got pipeline_parallel_degree {pp}.")
    _require(p.sharding not in ("stage2", "stage3") or pp == 1,
             f"parallel.sharding '{p.sharding}' with pipeline_parallel_degree {pp}: gradients and weights are "
             "sharded by the package's own step, and fleet's pipeline schedule runs a backward of its own (as "
             "Paddle refuses its stage 3 with a pipeline); use 'stage1' with a pipeline, or pipeline degree 1.")
    tp = p.tensor_parallel_degree
    if tp > 1:
        for name, value in (("num_attention_heads", m.num_attention_heads),
                            ("num_key_value_heads", m.num_key_value_heads), ("vocab_size", m.vocab_size),
                            ("intermediate_size", m.intermediate_size)):
            _require(value % tp == 0, f"model.{name} ({value}) must be divisible by "
                                      f"parallel.tensor_parallel_degree ({tp}): it is split over those ranks.")
        shared = m.moe_intermediate_size[0] * m.moe_num_shared_experts if m.moe_num_experts else 0
        _require(shared % tp == 0, f"the shared experts' width ({shared} = moe_intermediate_size[0] x "
                                   f"moe_num_shared_experts) must be divisible by parallel.tensor_parallel_degree "
                                   f"({tp}).")
    if cfg.training.loss_subbatch_seqlen:
        chunk, seq = cfg.training.loss_subbatch_seqlen, cfg.data.max_seq_len
        _require(chunk < seq, f"training.loss_subbatch_seqlen ({chunk}) is not shorter than data.max_seq_len ({seq}): "
                              "one chunk would be the whole sequence; set a shorter chunk, or 0.")
        _require(not p.sequence_parallel or chunk % tp == 0,
                 f"training.loss_subbatch_seqlen ({chunk}) must be divisible by parallel.tensor_parallel_degree "
                 f"({tp}) with sequence_parallel: each rank holds an equal piece of every chunk.")
    _require(not p.sequence_parallel or tp > 1,
             "parallel.sequence_parallel splits activations over tensor-parallel ranks; it needs "
             "parallel.tensor_parallel_degree > 1 (or set it to false).")
    if p.sequence_parallel:
        _require(cfg.data.max_seq_len % tp == 0,
                 f"data.max_seq_len ({cfg.data.max_seq_len}) must be divisible by parallel.tensor_parallel_degree "
                 f"({tp}) with sequence_parallel: each rank keeps an equal piece of the sequence.")
        _require(p.moe_group == "mp" or not m.moe_num_experts,
                 "parallel.sequence_parallel with moe_group 'ep' is not supported; use moe_group 'mp' (experts "
                 "spread over the tensor-parallel ranks).")
    _require((p.sharding_parallel_degree > 1) == bool(p.sharding),
             f"parallel.sharding_parallel_degree ({p.sharding_parallel_degree}) and parallel.sharding "
             f"('{p.sharding}') go together: set sharding to stage1, stage2 or stage3 with a degree above 1, or leave "
             "sharding empty with degree 1.")
    counts = m.moe_num_experts
    if p.moe_group == "mp":
        _require(p.expert_parallel_degree in (1, tp),
                 f"parallel.moe_group 'mp' spreads experts over the {tp} tensor-parallel ranks; leave "
                 f"parallel.expert_parallel_degree at 1 (or {tp}), got {p.expert_parallel_degree}.")
        _require(all(n % tp == 0 for n in counts),
                 f"model.moe_num_experts {counts}: with moe_group 'mp' every modality's expert count must be "
                 f"divisible by parallel.tensor_parallel_degree ({tp}).")
    ep = p.expert_parallel_degree
    if ep > 1 and p.moe_group == "ep":
        _require(all(n % ep == 0 for n in counts),
                 f"model.moe_num_experts {counts}: every modality's expert count must be divisible by "
                 f"parallel.expert_parallel_degree ({ep}).")
