"""``python -m ernie_moe.doctor [--layouts]``: the environment, then every computation the model runs checked
against a plain reference on this device (in each dtype it has), then with ``--layouts`` a few steps of data,
tensor, expert and pipeline parallelism on two local processes against one. Exit 1 when a check fails."""

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

from ..nn.kernels import chosen_on
from ..parallel import cpu_fallbacks
from .kernels import device_dtypes, run_checks
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
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="No ccache found")
    for key, value in environment():
        print(f"{key:<10} {value}")
    checks = run_checks(device_dtypes())
    print(f"{'kernels':<10} {chosen_on(paddle.zeros([1]).place)}")  # after the checks: a failed fused kernel shows
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


if __name__ == "__main__":
    sys.exit(main())
