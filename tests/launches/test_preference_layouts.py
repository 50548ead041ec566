"""Preference tuning in every kind of layout against one process: same config, seed and global batch of pairs.

Each run starts from the same base (a short supervised run) and takes 5 DPO steps on the synthetic pairs; its
reference model is placed in the layout too (the starting weights kept on the ranks that hold them, or with
LoRA the base with the adapters switched off). Losses, rewards, reward accuracy and gradient norms of every step,
the held-out figures and every trained weight must equal the single process's. The routers' aux-loss-free bias
moves (the reference keeps the starting one), and router losses are on, taken over every data rank's tokens.
"""

import numpy as np
import pytest
from support.layouts import ACCUMULATE, PP2, TP2
from support.runs import adapter, launch, load_model, records

pytestmark = pytest.mark.slow  # starts processes

STEPS, ROWS = 5, 4
COMMON = [f"training.max_steps={STEPS}", "logging.logging_steps=1", f"training.eval_steps={STEPS}",
          "training.stage=dpo", "training.adam_epsilon=1e-6", "training.learning_rate=1e-2",
          "training.warmup_steps=0", "data.num_eval_samples=7", "training.per_device_eval_batch_size=1",
          "model.global_aux_loss=true", "model.moe_use_aux_free=true", "model.moe_aux_free_update_coef=0.01",
          "data.num_train_samples=64"]
EP2 = "parallel.expert_parallel_degree=2"
LORA = ["training.fine_tuning=lora", "training.lora_rank=4"]
# kto_pair's KL estimate is a mean over the pairs of a global micro-batch, on every data rank: the evaluation
# batches too hold the same pairs in both runs (2 rows in one process, 1 on each of 2 data ranks)
KTO = ["training.dpo_loss=kto_pair", "training.dpo_beta=0.5", "training.per_device_eval_batch_size=2"]
FIGURES = ("loss", "dpo/rewards_chosen", "dpo/rewards_rejected", "dpo/logps_chosen", "dpo/logps_rejected",
           "aux_loss", "grad_norm")

# name: (processes, data ranks, layout overrides, overrides shared with the reference run)
LAYOUTS = {
    "dp2": (2, 2, [], []),
    "tp2": (2, 1, [TP2], []),
    "pp2": (2, 1, [PP2], ACCUMULATE),
    "ep2": (2, 2, [EP2], []),
    "tp2_pp2": (4, 1, [TP2, PP2], ACCUMULATE),
    "lora_tp2": (2, 1, [TP2], LORA),
    "dp2_kto_pair": (2, 2, ["training.per_device_eval_batch_size=1"], KTO),
    # sharding stage 3: the policy's weights split over the sharding ranks, the reference copy whole on each
    "sharding2_stage3": (2, 2, ["parallel.sharding_parallel_degree=2", "parallel.sharding=stage3"], []),
    # every pair's reference figures computed through the pipeline before the first step, against one process that
    # keeps the reference weights
    "pp2_precomputed": (2, 1, [PP2, "training.dpo_reference=precomputed"], ACCUMULATE),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("base")
    out, _ = launch(tmp, 1, "training.max_steps=30", "training.eval_steps=0", name="base")
    return out / "final_model"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, base):
    runs = {}

    def get(shared: list[str]):
        if tuple(shared) not in runs:
            tmp = tmp_path_factory.mktemp("one")
            runs[tuple(shared)], _ = launch(tmp, 1, *COMMON, f"training.model_name_or_path={base}", *shared,
                                            f"training.per_device_train_batch_size={ROWS}", name="one")
        return runs[tuple(shared)]

    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_preference_layout_matches_one_process(tmp_path, base, reference, layout):
    nproc, data_ranks, overrides, shared = LAYOUTS[layout]
    one = reference(shared)
    many, _ = launch(tmp_path, nproc, *COMMON, f"training.model_name_or_path={base}", *shared, *overrides,
                     f"training.per_device_train_batch_size={ROWS // data_ranks}", name=layout)
    train = [[r for r in records(out) if "loss" in r] for out in (one, many)]
    assert len(train[1]) == STEPS
    np.testing.assert_allclose(train[0][0]["dpo/loss"], np.log(2) if not shared == KTO else 0.5, rtol=1e-5)
    assert abs(train[0][-1]["dpo/reward_margin"]) > 1e-3  # the policy has moved from its reference
    for key in FIGURES:
        np.testing.assert_allclose([r[key] for r in train[1]], [r[key] for r in train[0]], rtol=1e-4, atol=1e-5,
                                   err_msg=key)
    # at the first step the policy is its reference: every margin is 0 up to the layout's float32 rounding (the
    # rewards above agree within 1e-5), whose sign the accuracy would count (a pipeline's precomputed reference
    # gave 0.375 against 0.0 on an AVX-512 machine); once the policy has moved the counts must agree exactly
    assert [r["dpo/reward_accuracy"] for r in train[1][1:]] == [r["dpo/reward_accuracy"] for r in train[0][1:]]
    evals = [[r for r in records(out) if "eval_loss" in r][-1] for out in (one, many)]
    for key in ("eval_loss", "eval_reward_margin", "eval_logps_chosen"):
        # as the training figures: a margin near zero (-0.036) carries the layouts' float32 rounding (3.7e-6 on an
        # Intel Xeon) above 1e-4 of itself
        np.testing.assert_allclose(evals[1][key], evals[0][key], rtol=1e-4, atol=1e-5, err_msg=key)
    assert evals[1]["eval_reward_accuracy"] == evals[0]["eval_reward_accuracy"]
    if shared == LORA:
        a, b = adapter(one / "final_model"), adapter(many / "final_model")
    else:
        a, b = load_model(one / "final_model"), load_model(many / "final_model")
        # the base has no bias: the policy's starts at 0 and moves, the reference's stays 0
        assert any(np.abs(a[n]).max() > 1e-3 for n in a if n.endswith("e_score_correction_bias"))
    assert set(a) == set(b)
    for name in a:
        # at a learning rate of 1e-2, an element whose gradient nearly cancels carries its layout's float32
        # summation order through AdamW's normalisation (one of 4096 differed by 1.2e-5 at tp2, 7e-5 of a LoRA A)
        np.testing.assert_allclose(b[name], a[name], rtol=1e-4, atol=1e-4, err_msg=name)
