"""Every parallel layout against one process: same config, seed and global batch, in float32.

Each layout is launched for real (``paddle.distributed.launch``, gloo on CPU) and must reproduce the
single-process losses of every step, the gradient norms, the evaluation and every final weight (the
exported model holds full tensors whatever the layout). Capacity is unlimited, so no token is dropped.
"""

import json

import numpy as np
import pytest
from test_e2e import launch, load_model, records

STEPS = 5
COMMON = [f"training.max_steps={STEPS}", "logging.logging_steps=1", f"training.eval_steps={STEPS}",
          "training.adam_epsilon=1e-6", "data.num_eval_samples=7", "training.per_device_eval_batch_size=1"]
# Router losses are computed from each data rank's own tokens (as ERNIE does), so layouts that split the
# batch over data ranks are compared with them off; layouts whose ranks all see the whole batch keep them on.
NO_ROUTER_LOSSES = ["model.moe_aux_loss_lambda=0", "model.moe_z_loss_lambda=0", "model.moe_orthogonal_loss_lambda=0"]
GLOBAL_ROWS = 4

# name: (processes, data ranks, overrides)
LAYOUTS = {
    "dp2": (2, 2, []),
    "tp2": (2, 1, ["parallel.tensor_parallel_degree=2"]),
    "tp2_sp": (2, 1, ["parallel.tensor_parallel_degree=2", "parallel.sequence_parallel=true",
                      "parallel.moe_group=mp"]),
    "tp2_moe_mp": (2, 1, ["parallel.tensor_parallel_degree=2", "parallel.moe_group=mp"]),
    "sharding2": (2, 2, ["parallel.sharding_parallel_degree=2", "parallel.sharding=stage1"]),
    "ep2": (2, 2, ["parallel.expert_parallel_degree=2"]),
    "dp2_tp2": (4, 2, ["parallel.tensor_parallel_degree=2"]),
    "dp2_tp2_moe_mp_sp": (4, 2, ["parallel.tensor_parallel_degree=2", "parallel.moe_group=mp",
                                 "parallel.sequence_parallel=true"]),
    "ep2_sharding2": (4, 4, ["parallel.sharding_parallel_degree=2", "parallel.sharding=stage1",
                             "parallel.expert_parallel_degree=2"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process runs, with and without router losses, computed once for the module."""
    runs = {}

    def get(router_losses: bool):
        if router_losses not in runs:
            tmp = tmp_path_factory.mktemp(f"one_router{int(router_losses)}")
            extra = [] if router_losses else NO_ROUTER_LOSSES
            runs[router_losses], _ = launch(tmp, 1, *COMMON, *extra,
                                            f"training.per_device_train_batch_size={GLOBAL_ROWS}", name="one")
        return runs[router_losses]

    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(tmp_path, reference, layout):
    nproc, data_ranks, overrides = LAYOUTS[layout]
    router_losses = data_ranks == 1
    one = reference(router_losses)
    many, _ = launch(tmp_path, nproc, *COMMON, *overrides, *([] if router_losses else NO_ROUTER_LOSSES),
                     f"training.per_device_train_batch_size={GLOBAL_ROWS // data_ranks}", name=layout)
    train = [[r for r in records(out) if "loss" in r] for out in (one, many)]
    assert len(train[1]) == STEPS
    np.testing.assert_allclose([r["loss"] for r in train[1]], [r["loss"] for r in train[0]], rtol=1e-4)
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
        np.testing.assert_allclose(b[name], a[name], rtol=1e-4, atol=1e-5, err_msg=name)
    config = json.loads((many / "final_model" / "config.json").read_text())
    assert config["num_attention_heads"] == 4  # the full model's config, not a rank's slice
