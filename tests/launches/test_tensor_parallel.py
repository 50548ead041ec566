"""Tensor-parallel layers and expert dispatchers on 2 real ranks against their unsharded references (see
dist_tensor_parallel_layers.py)."""

import os
import sys

import numpy as np
import pytest
from support.runs import ROOT, run_launch

from ernie_moe.nn.sharding import shard_index


def test_shard_index_splits_every_segment():
    # q (4 columns), k (2), v (2) over 2 ranks: each rank keeps whole pieces of all three
    assert shard_index([4, 2, 2], 0, 2).tolist() == [0, 1, 4, 6]
    assert shard_index([4, 2, 2], 1, 2).tolist() == [2, 3, 5, 7]
    both = np.sort(np.concatenate([shard_index([6, 4], r, 2) for r in range(2)]))
    assert both.tolist() == list(range(10))


@pytest.mark.slow
def test_parallel_layers_match_unsharded_references(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
           str(tmp_path / "log"), str(ROOT / "tests" / "support" / "dist_tensor_parallel_layers.py")]
    result = run_launch(cmd, tmp_path / "log", env=env, timeout=300)
    logs = [(tmp_path / "log" / f"workerlog.{r}").read_text() for r in range(2)]
    assert result.returncode == 0, result.stderr[-2000:] + logs[0][-3000:] + logs[1][-3000:]
    for r in range(2):
        assert f"tensor-parallel layers OK on rank {r}" in logs[r]
