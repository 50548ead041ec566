"""Where a step's time goes: the parts and what they leave over make up the step, each counted once."""

import json
import time

import pytest
from support.runs import ROOT

from ernie_moe.config import load_config
from ernie_moe.timing import StepTimes
from ernie_moe.training import Trainer

SMALL = ["data.image_size=56", "data.max_seq_len=48", "training.per_device_train_batch_size=2",
         "logging.visualdl=false", "training.eval_steps=0", "data.num_eval_samples=0", "training.max_steps=3",
         "logging.logging_steps=1", "training.gradient_accumulation_steps=2"]


def logged(tmp_path, *overrides):
    Trainer(load_config(ROOT / "configs" / "vl_moe.yaml", [*SMALL, f"training.output_dir={tmp_path}",
                                                           *overrides])).train()
    return [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_the_parts_and_the_rest_make_up_the_step(tmp_path):
    for record in logged(tmp_path):
        parts = {k: v for k, v in record.items() if k.startswith("time/") and k.endswith("_s")}
        assert {"time/data_s", "time/forward_s", "time/backward_s", "time/gradient_sync_s", "time/optimizer_s",
                "time/step_reduce_s", "time/other_s"} == set(parts)
        assert all(v >= 0 for v in parts.values()), parts
        assert sum(parts.values()) == pytest.approx(record["step_time_s"], rel=1e-6)  # as logged: 8 digits
        assert 0 <= record["time/communication_share"] < 1


def test_the_breakdown_can_be_turned_off(tmp_path):
    assert not any(k.startswith("time/") for r in logged(tmp_path, "logging.time_breakdown=false") for k in r)


def test_nested_parts_count_their_time_once():
    """A collective inside the forward pass is the collective's time, not the forward's as well."""
    times = StepTimes()
    times.enabled = True
    start = time.perf_counter()
    with times.part("forward"):
        time.sleep(0.01)
        with times.part("tensor_parallel_comm"):
            time.sleep(0.02)
    with times.part("forward"):
        pass
    outer = time.perf_counter() - start
    totals = times.pop()
    assert set(totals) == {"forward", "tensor_parallel_comm"}
    assert totals["tensor_parallel_comm"] >= 0.02 and totals["forward"] >= 0.01
    assert totals["forward"] + totals["tensor_parallel_comm"] <= outer  # counted twice, it would pass outer
    assert times.pop() == {}


def test_fleets_pipeline_schedule_still_has_the_parts_the_timing_wraps():
    """The installed fleet's PipelineParallel has the private step methods and send / receive helper that the
    pipeline timing wraps; a schedule without them is refused naming each one."""
    import inspect
    import types

    from paddle.distributed.fleet.meta_parallel import PipelineParallel
    from paddle.distributed.fleet.meta_parallel.pp_utils.p2p_communication import P2pHelper

    from ernie_moe.parallel.pipeline import (
        FLEET_P2P_HELPER,
        FLEET_STEP_METHODS,
        missing_schedule_parts,
        time_schedule_parts,
    )

    made_in_init = f"self.{FLEET_P2P_HELPER} =" in inspect.getsource(PipelineParallel.__init__)
    installed = types.SimpleNamespace(**{m: getattr(PipelineParallel, m, None) for m in FLEET_STEP_METHODS},
                                      **{FLEET_P2P_HELPER: P2pHelper if made_in_init else None})
    assert missing_schedule_parts(installed) == []
    renamed = types.SimpleNamespace(_forward_step=lambda: None, _p2p_helper=object())
    with pytest.raises(RuntimeError, match=r"PipelineParallel\._backward_step, object\.send_\* / recv_\*"):
        time_schedule_parts(renamed)
