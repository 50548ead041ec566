"""Every parallel layout against one process: same config, seed and global batch, in float32.

Each layout is launched for real (``paddle.distributed.launch``, gloo on CPU) and must reproduce the
single-process losses of every step, the gradient norms, the evaluation and every final weight (the
exported model holds full tensors whatever the layout), and the EMA of the weights and its evaluation. The
replica check runs after every step and must find every replica equal. Capacity is unlimited, so no token is
dropped.
"""

import json

import numpy as np
import pytest
from support.layouts import ACCUMULATE, MTP, PP2, TP2
from support.runs import launch, load_model, records

from ernie_moe.host_reads import DECLARED

pytestmark = pytest.mark.slow  # starts processes

STEPS = 5
# Router losses on, their statistics taken over every data rank's tokens (global_aux_loss), so the losses do
# not depend on how the batch is split; aux-loss-free balancing on, its bias updated from counts summed over
# the data ranks (the bias is among the compared weights). 7 evaluation samples pack into 3 rows: with two
# data ranks one rank gets none in the last evaluation batch and must run an unlabelled copy rather than skip
# the collectives.
COMMON = [f"training.max_steps={STEPS}", "logging.logging_steps=1", f"training.eval_steps={STEPS}",
          "training.adam_epsilon=1e-6", "data.num_eval_samples=7", "training.per_device_eval_batch_size=1",
          "model.global_aux_loss=true", "model.moe_use_aux_free=true", "model.moe_aux_free_update_coef=0.01",
          "training.ema_decay=0.5", "training.ema_start_step=2", "training.replica_check_steps=1",
          "logging.count_host_reads=true"]
ROWS = 4  # rows of each global micro-batch
# fleet's interleaved schedule needs 3 stages or more and 2 x stages micro-batches: 4 stages x 2 chunks of one layer
INTERLEAVED = ["training.gradient_accumulation_steps=8", "model.num_hidden_layers=8"]
RECOMPUTE = "training.recompute=true"
SHARDING2 = "parallel.sharding_parallel_degree=2"
MTP_ONLY = MTP + ["training.freeze=[vision,adapter,lm]"]

# name: (processes, data ranks, layout overrides, overrides shared with the reference run)
LAYOUTS = {
    "dp2": (2, 2, [], []),
    # each global micro-batch's rows dealt by their vision patches (here all alike: interleaved, not contiguous)
    "dp2_vision_balance": (2, 2, ["data.balance=vision"], []),
    "tp2": (2, 1, [TP2], []),
    "tp2_sp": (2, 1, [TP2, "parallel.sequence_parallel=true", "parallel.moe_group=mp"], []),
    "tp2_moe_mp": (2, 1, [TP2, "parallel.moe_group=mp"], []),
    "ep2": (2, 2, ["parallel.expert_parallel_degree=2"], []),
    # the overlapped gradient sync skips the first micro-batch's backward and syncs the sum in the second's
    "ep2_accumulate": (2, 2, ["parallel.expert_parallel_degree=2"], ACCUMULATE),
    "pp2": (2, 1, [PP2], ACCUMULATE),
    "pp4_vpp2": (4, 1, ["parallel.pipeline_parallel_degree=4", "parallel.virtual_pp_degree=2"], INTERLEAVED),
    "dp2_tp2": (4, 2, [TP2], []),
    "dp2_tp2_moe_mp_sp": (4, 2, [TP2, "parallel.moe_group=mp", "parallel.sequence_parallel=true"], []),
    "ep2_sharding2": (4, 4, ["parallel.sharding_parallel_degree=2", "parallel.sharding=stage1",
                             "parallel.expert_parallel_degree=2"], []),
    # gradients (stage 2), and weights too (stage 3), each held by one owner of the sharding ranks: over two
    # micro-batches, beside a data-parallel copy, the experts split over the sharding ranks, tensor x sequence
    # parallelism with the experts over the tensor ranks, recompute, multi-token prediction, the head over chunks
    "sharding2_stage2": (2, 2, [SHARDING2, "parallel.sharding=stage2"], ACCUMULATE),
    "sharding2_stage3": (2, 2, [SHARDING2, "parallel.sharding=stage3"], []),
    "sharding2_stage3_accumulate_recompute": (2, 2, [SHARDING2, "parallel.sharding=stage3", RECOMPUTE], ACCUMULATE),
    "dp2_sharding2_stage3": (4, 4, [SHARDING2, "parallel.sharding=stage3"], []),
    "ep2_sharding2_stage3": (4, 4, [SHARDING2, "parallel.sharding=stage3", "parallel.expert_parallel_degree=2"], []),
    "tp2_sp_sharding2_stage3": (4, 2, [TP2, "parallel.sequence_parallel=true", "parallel.moe_group=mp", SHARDING2,
                                       "parallel.sharding=stage3"], []),
    "sharding2_stage3_mtp_chunked_loss": (2, 2, [SHARDING2, "parallel.sharding=stage3",
                                                 "training.loss_subbatch_seqlen=16"], MTP),
    "tp2_pp2": (4, 1, [TP2, PP2], ACCUMULATE),
    "dp2_pp2_ep2": (4, 2, [PP2, "parallel.expert_parallel_degree=2"], ACCUMULATE),
    # recompute (against a single process without it): collectives and pipeline stages inside recomputed blocks
    "tp2_recompute_full": (2, 1, [TP2, RECOMPUTE], []),
    "pp2_recompute_full_attn": (2, 1, [PP2, RECOMPUTE, "training.recompute_granularity=full_attn"], ACCUMULATE),
    "ep2_recompute_moe": (2, 2, ["parallel.expert_parallel_degree=2", RECOMPUTE,
                                 "training.recompute_granularity=moe"], []),
    # each rank's experts as batched matmuls (against one process running them one by one)
    "ep2_grouped_matmul": (2, 2, ["parallel.expert_parallel_degree=2", "training.moe_expert_matmul=grouped"], []),
    # the LM head and the vocabulary-parallel loss over sequence chunks (against one process without chunks)
    "tp2_chunked_loss": (2, 1, [TP2, "training.loss_subbatch_seqlen=16"], []),
    # ... under sequence parallelism (each rank a piece of every chunk), and on a pipeline's last stage, with the
    # tied embedding's copy there or an LM head of its own
    "tp2_sp_chunked_loss": (2, 1, [TP2, "parallel.sequence_parallel=true", "parallel.moe_group=mp",
                                   "training.loss_subbatch_seqlen=16"], []),
    "pp2_chunked_loss": (2, 1, [PP2, "training.loss_subbatch_seqlen=16"], ACCUMULATE),
    "pp2_chunked_loss_untied": (2, 1, [PP2, "training.loss_subbatch_seqlen=16"],
                                ACCUMULATE + ["model.tie_word_embeddings=false"]),
    # the long-sequence layout: tensor x pipeline, the experts over the tensor ranks, sequence parallel (the ViT
    # over each rank's share of the frames), the loss over chunks
    "tp2_pp2_moe_mp_sp_chunked_loss": (4, 1, [TP2, PP2, "parallel.moe_group=mp", "parallel.sequence_parallel=true",
                                              "training.loss_subbatch_seqlen=16"], ACCUMULATE),
    # multi-token prediction: its projection over whole sequences under sequence parallelism (recomputed), its
    # layer and loss on the last pipeline stage (the embeddings carried there), beside expert parallelism, its
    # optimizer states sharded, and trained alone over the frozen model
    "tp2_sp_recompute_mtp": (2, 1, [TP2, "parallel.sequence_parallel=true", "parallel.moe_group=mp", RECOMPUTE], MTP),
    "pp2_mtp": (2, 1, [PP2], ACCUMULATE + MTP),
    "ep2_mtp": (2, 2, ["parallel.expert_parallel_degree=2"], MTP),
    "sharding2_mtp": (2, 2, ["parallel.sharding_parallel_degree=2", "parallel.sharding=stage1"], MTP),
    "dp2_mtp_only": (2, 2, [], MTP_ONLY),
}


# Each rank's device-to-host reads in its training steps: exactly the reads that ernie_moe.host_reads declares, as
# many as each layout makes (the default model has one MoE layer: decoder layer 1), and no other.
COUNTED = {"one", "dp2", "tp2", "pp2", "ep2"}


def expected_reads(layout: str, rank: int, micro_batches: int) -> dict:
    steps = STEPS - 1  # the first step is not counted (its one-time reads set things up)
    stage = rank if layout == "pp2" else 0  # pp2: the MoE layer and the loss are on the last stage
    reads = {"finite_check": steps}
    if stage == 0:
        reads["host_inputs"] = micro_batches * steps  # the images' grid, read by the vision blocks
    if layout != "pp2" or stage == 1:
        reads["expert_rows"] = micro_batches * steps
    if layout == "ep2":  # the CPU all-to-all's sizes: the rows out and back, forward and backward
        reads["cpu_all_to_all"] = 4 * micro_batches * steps
    if layout != "one":
        reads["memory_guard"] = steps  # the peak over the ranks, once a logging window (every step here)
    return reads


def check_host_reads(out, layout: str, micro_batches: int) -> None:
    reads = json.loads((out / "summary.json").read_text())["host_reads"]
    assert reads["steps"] == STEPS - 1
    for rank, counted in enumerate(reads["per_rank"]):
        assert counted["undeclared"] == {}, (layout, rank)
        assert set(counted["declared"]) <= set(DECLARED)
        assert counted["declared"]["finite_check"] == STEPS - 1  # every layout: one read a step
        if layout in COUNTED:
            assert counted["declared"] == expected_reads(layout, rank, micro_batches), (layout, rank)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process runs, one per set of shared overrides, each made once for the module."""
    runs = {}

    def get(shared: list[str]):
        key = tuple(shared)
        if key not in runs:
            tmp = tmp_path_factory.mktemp("one")
            runs[key], _ = launch(tmp, 1, *COMMON, *shared, f"training.per_device_train_batch_size={ROWS}",
                                  name="one")
        return runs[key]

    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(tmp_path, reference, layout):
    nproc, data_ranks, overrides, shared = LAYOUTS[layout]
    one = reference(shared)
    many, _ = launch(tmp_path, nproc, *COMMON, *shared, *overrides,
                     f"training.per_device_train_batch_size={ROWS // data_ranks}", name=layout)
    train = [[r for r in records(out) if "loss" in r] for out in (one, many)]
    assert len(train[1]) == STEPS
    micro_batches = 2 if shared == ACCUMULATE else 8 if shared == INTERLEAVED else 1
    check_host_reads(one, "one" if layout in COUNTED else "reference", micro_batches)
    check_host_reads(many, layout, micro_batches)
    assert all(r["aux_loss"] > 0 for r in train[0])
    mtp = "model.num_nextn_predict_layers=1" in shared
    if mtp:
        assert all(r["mtp/depth1_loss"] > 0 and r["mtp/loss"] == r["mtp/depth1_loss"] for r in train[0])
    for key in ("loss", "aux_loss", "z_loss") + (("mtp/depth1_loss",) if mtp else ()):
        np.testing.assert_allclose([r[key] for r in train[1]], [r[key] for r in train[0]], rtol=1e-4, err_msg=key)
    np.testing.assert_allclose([r["grad_norm"] for r in train[1]], [r["grad_norm"] for r in train[0]], rtol=1e-4)
    # expert counters count every token once, however the layout splits or repeats them
    key = "moe/layer1_vision/routed_tokens"
    assert [r[key] for r in train[1]] == [r[key] for r in train[0]]
    evals = [[r for r in records(out) if "eval_loss" in r][-1] for out in (one, many)]
    np.testing.assert_allclose(evals[1]["eval_loss"], evals[0]["eval_loss"], rtol=1e-4)
    assert evals[1]["eval_caption_accuracy"] == evals[0]["eval_caption_accuracy"]
    a, b = load_model(one / "final_model"), load_model(many / "final_model")
    assert set(a) == set(b)
    for name in a:
        assert b[name].shape == a[name].shape, name
        # an element whose gradient nearly cancels carries its layout's float32 summation order (1.1e-6 at tp2 with
        # MKL's AVX2 code on an Intel CPU)
        np.testing.assert_allclose(b[name], a[name], rtol=1e-4, atol=1e-5, err_msg=name)
    # the EMA, split over the replicas that hold each weight, saved whole; evaluated beside the model
    a, b = (load_model(out / f"checkpoint-{STEPS}", "ema.index.json") for out in (one, many))
    # every weight that trains (the aux-loss-free bias is set by the trainer's counts, not averaged)
    untrained = set(load_model(one / f"checkpoint-{STEPS}")) - set(a)
    frozen = (lambda n: not n.startswith("model.mtp_")) if shared == MTP_ONLY else (lambda n: False)
    assert untrained and all(n.endswith("e_score_correction_bias") or frozen(n) for n in untrained)
    assert set(b) == set(a) and any(n.startswith("model.mtp_") for n in a) == mtp
    for name in a:  # an average of the weights agrees as closely as they do
        np.testing.assert_allclose(b[name], a[name], rtol=1e-4, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(evals[1]["ema_eval_loss"], evals[0]["ema_eval_loss"], rtol=1e-4)
    checks = [r for r in records(many) if "replicas/max_abs_diff" in r]
    assert [r["step"] for r in checks] == (list(range(STEPS + 1)) if data_ranks > 1 else [])
    assert all(r["replicas/differing_copies"] == 0 for r in checks)
    config = json.loads((many / "final_model" / "config.json").read_text())
    assert config["num_attention_heads"] == 4  # the full model's config, not a rank's slice
    # rank 0's step-time breakdown names the collectives it runs (as the first pipeline stage it holds only the
    # dense layer 0, so no expert all-to-all)
    parts = {key for r in train[1] for key, value in r.items() if key.startswith("time/") and value > 0}
    assert ("time/tensor_parallel_comm_s" in parts) == (TP2 in overrides)
    experts_on_rank0 = any("expert_parallel_degree" in o for o in overrides) and PP2 not in overrides
    assert ("time/expert_all_to_all_s" in parts) == experts_on_rank0
    if any("pipeline_parallel_degree" in o for o in overrides):
        # the first stage waits for the later stages' gradients, and sends its activations
        assert {"time/pipeline_bubble_s", "time/pipeline_send_recv_s"} <= parts
    else:
        assert not any("pipeline" in name for name in parts)
    assert {"time/forward_s", "time/backward_s"} <= parts
    for r in train[1]:  # the parts, what they leave over included, make up the step as logged (8 digits)
        seconds = [v for k, v in r.items() if k.startswith("time/") and k.endswith("_s")]
        assert min(seconds) >= 0 and sum(seconds) == pytest.approx(r["step_time_s"], rel=1e-6)
    assert all(0 <= r["time/communication_share"] < 1 for r in train[1])
