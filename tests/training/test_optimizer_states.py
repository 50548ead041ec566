"""Where optimizer states live: offloaded to host memory between steps, sharded over expert replicas.

The arithmetic must be that of one AdamW over every parameter on every rank: these runs are compared with
the plain one, step by step and weight by weight.
"""

import numpy as np
import pytest
from support.runs import launch, load_model, records, trained

from ernie_moe.training import offload
from ernie_moe.training.offload import OffloadedOptimizer, buckets


def test_buckets_keep_the_order_and_stay_under_the_limit():
    class P:
        def __init__(self, size):
            self.size = size

    params = [P(n) for n in (10, 20, 5, 40, 3)]
    runs = buckets(params, 8, limit=8 * 30)
    assert [[p.size for p in run] for run in runs] == [[10, 20], [5], [40], [3]]  # a larger tensor goes alone


def test_offloaded_states_train_exactly_as_resident_ones(tmp_path, monkeypatch):
    """Buckets of about a tenth of the model, each its own AdamW: 5 steps give the same losses and weights."""
    plain, plain_weights, _ = trained(tmp_path / "plain")
    monkeypatch.setattr(offload, "BUCKET_BYTES", 8 * 30_000)
    moved, moved_weights, tr = trained(tmp_path / "offloaded", "training.offload_optim=true")
    assert isinstance(tr.parts.optimizer, OffloadedOptimizer) and len(tr.parts.optimizer.parts) >= 5
    # every state was sent to host memory after its bucket's update, and is known to come back
    held = [t for part in tr.parts.optimizer.parts for table in part._accumulators.values() for t in table.values()]
    assert held and all(id(t) in tr.parts.optimizer.home for t in held)
    np.testing.assert_allclose(moved, plain, rtol=1e-5)
    for name, value in plain_weights.items():
        np.testing.assert_allclose(moved_weights[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.slow
def test_sharded_expert_states_and_offload_train_as_whole_resident_states(tmp_path):
    """4 ranks with the experts split in two (ep2), each expert held by two ranks: with optimizer sharding
    the experts' states are split over those two, the rest by fleet's sharding; with and without offload.
    Against the same ranks without sharding; the offloaded run's checkpoint resumes on one process."""
    common = ["training.max_steps=5", "training.save_steps=3", "logging.logging_steps=1", "training.eval_steps=0",
              "training.adam_epsilon=1e-6", "model.global_aux_loss=true"]
    ep2 = [*common, "parallel.expert_parallel_degree=2", "training.per_device_train_batch_size=1"]
    sharded = [*ep2, "parallel.sharding_parallel_degree=2", "parallel.sharding=stage1"]
    runs = {"resident": launch(tmp_path, 4, *ep2, name="resident")[0],
            "sharded": launch(tmp_path, 4, *sharded, name="sharded")[0],
            "offloaded": launch(tmp_path, 4, *sharded, "training.offload_optim=true", name="offloaded")[0]}
    loss = {name: [r["loss"] for r in records(out) if "loss" in r] for name, out in runs.items()}
    weights = {name: load_model(out / "final_model") for name, out in runs.items()}
    optimizer = {name: max(v for k, v in [r for r in records(out) if "loss" in r][-1].items()
                           if k.endswith("/optimizer_states_gb")) for name, out in runs.items()}
    assert optimizer["sharded"] < 0.6 * optimizer["resident"]  # every state split over two ranks
    for name in ("sharded", "offloaded"):
        np.testing.assert_allclose(loss[name], loss["resident"], rtol=1e-5, err_msg=name)
        for key, value in weights["resident"].items():
            np.testing.assert_allclose(weights[name][key], value, rtol=1e-5, atol=1e-6, err_msg=f"{name} {key}")
    resumed, _ = launch(tmp_path, 1, *common, "training.per_device_train_batch_size=4",
                        f"training.resume_from_checkpoint={runs['offloaded'] / 'checkpoint-3'}", name="resumed")
    np.testing.assert_allclose([r["loss"] for r in records(resumed) if "loss" in r], loss["resident"][3:], rtol=1e-4)
