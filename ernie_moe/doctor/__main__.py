"""``python -m ernie_moe.doctor [--layouts] [--config FILE [section.key=value ...]]``: the environment, then every
computation the model runs checked against a plain reference on this device (in each dtype it has), then with
``--layouts`` a few steps of data, tensor, expert and pipeline parallelism on two local processes against one.
With ``--config`` also your model's attention, norm and routed experts at its own widths, and the memory plan of
your layout on this device (``--world-size``, ``--device-memory-gb``). Exit 1 when a check fails, 2 on a config
that does not load."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import paddle

from ..cli import at_least_one, bounded
from ..config import ConfigError, load_config
from ..config.schema import Config
from ..memory.report import GIB, default_world, planned
from ..memory.search import FIT_FRACTION, describe
from ..monitor.memory import MemoryMonitor
from ..nn.kernels import chosen_on
from ..parallel import cpu_fallbacks
from .kernels import Check, device_dtypes, model_checks, run_checks
from .layouts import check_layouts


def environment() -> list[tuple[str, str]]:
    rows = [("python", platform.python_version()), ("paddle", f"{paddle.__version__} ({paddle.version.commit[:10]})"),
            ("device", paddle.device.get_device()), ("cpu cores", str(os.cpu_count()))]
    if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count():
        rows.append(("backend", "nccl"))
        for i in range(paddle.device.cuda.device_count()):
            props = paddle.device.cuda.get_device_properties(i)
            rows.append((f"gpu {i}", f"{props.name}, {props.total_memory / 2 ** 30:.1f} GiB"))
    else:
        rows.append(("backend", "gloo (CPU)"))
        # as the trainer does on a CPU, so the checks below run the code path training runs
        if cpu_fallbacks.use_avx2_math_on_amd():
            rows.append(("math", "MKL's AVX2 path on this AMD CPU (MKL_DEBUG_CPU_TYPE=5)"))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", action="store_true", help="also run the 2-process layout checks")
    parser.add_argument("--workdir", help="where the layout runs write (default: a temporary folder)")
    parser.add_argument("--config", help="also check this training config's model shapes and layout")
    parser.add_argument("overrides", nargs="*", help="section.key=value, applied to --config")
    parser.add_argument("--world-size", type=at_least_one, help="ranks of the run (default: the product of the "
                                                                  "degrees)")
    parser.add_argument("--device-memory-gb", type=bounded(float, 0, low_included=False),
                        help="GB per device (default: training.device_memory_gb, else this machine's)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="No ccache found")
    cfg = None
    if args.config or args.overrides:
        try:
            cfg = load_config(args.config, args.overrides, check_paths=False)
        except ConfigError as err:
            print(f"config error: {err}", file=sys.stderr)
            return 2
    for key, value in environment():
        print(f"{key:<10} {value}")
    checks = run_checks(device_dtypes())
    print(f"{'kernels':<10} {chosen_on(paddle.zeros([1]).place)}")  # after the checks: a failed fused kernel shows
    if cfg is not None:
        checks += run_checks(device_dtypes(), checks_to_run=model_checks(cfg.model))
        checks.append(memory_plan(cfg, args.world_size, args.device_memory_gb))
    if args.layouts:
        with tempfile.TemporaryDirectory() as scratch:
            try:
                checks += check_layouts(Path(args.workdir or scratch))
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
                print(f"\nlayout checks could not run: {err}", file=sys.stderr)
                return 1
    print("\n| check | dtype | largest difference | tolerance | result |\n|---|---|---|---|---|")
    for check in checks:
        print(f"| {check.name} | {check.dtype} | {check.difference:.2e} | {check.tolerance:.0e} | "
              f"{'pass' if check.passed else 'FAIL'} |")
    failed = [check for check in checks if not check.passed]
    print(f"\n{len(checks) - len(failed)} of {len(checks)} checks passed")
    return 1 if failed else 0


def memory_plan(cfg: Config, world: int | None, device_gb: float | None) -> Check:
    """The configured layout's busiest rank, as the memory planner predicts it, over the device's size: it passes
    at the share the planner calls a fit."""
    world = world or default_world(cfg)
    device_gb = device_gb or cfg.training.device_memory_gb or MemoryMonitor().device_total_gb()
    stages, _, _, _ = planned(cfg, world)
    busiest = max(s.total for s in stages)
    print(f"{'layout':<10} {world} ranks, {describe(cfg)}: busiest rank {busiest / GIB:.2f} GiB of "
          f"{device_gb:g} GB predicted")
    return Check(f"memory plan of the layout on {world} ranks (share of the device)", "-", busiest / (device_gb * GIB),
                 FIT_FRACTION)


if __name__ == "__main__":
    sys.exit(main())
