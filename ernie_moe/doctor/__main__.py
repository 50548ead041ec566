"""``python -m ernie_moe.doctor [--layouts] [--config FILE [section.key=value ...]] [--serve FOLDER]``: the
environment, then every
computation the model runs checked against a plain reference on this device (in each dtype it has), then with
``--layouts`` a few steps of data, tensor, expert and pipeline parallelism on two local processes against one.
With ``--config`` also your model's attention, norm and routed experts at its own widths, and the memory plan of
your layout on this device (``--world-size``, ``--device-memory-gb``). With ``--serve FOLDER`` the serving engines
installed here load the model folder and answer a question about an image as this package does
(``doctor.serving``). Exit 1 when a check fails, 2 on a config that does not load."""

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

from ..checkpoint.errors import CheckpointError
from ..cli import MAX_GB, at_least_one, bounded
from ..config import ConfigError, load_config
from ..config.schema import Config
from ..data.encoding.packing import BadSample
from ..data.formats.jsonl import load_image
from ..generation import UsageError
from ..memory.report import GIB, default_world, planned
from ..memory.search import FIT_FRACTION, describe
from ..monitor.memory import MemoryMonitor
from ..nn.kernels import chosen_on
from ..parallel import cpu_fallbacks
from .kernels import Check, device_dtypes, model_checks, run_checks
from .layouts import check_layouts
from .serving import COMMANDS, check_serving, installed_engines


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
    parser.add_argument("--device-memory-gb", type=bounded(float, 0, MAX_GB, low_included=False),
                        help="GB per device (default: training.device_memory_gb, else this machine's)")
    parser.add_argument("--serve", metavar="FOLDER", help="serve this model folder with each engine installed here "
                                                           "and compare its answer with this package's")
    parser.add_argument("--engine", action="append", choices=sorted(COMMANDS),
                        help="with --serve: this engine only (repeatable; default: each one installed)")
    parser.add_argument("--engine-command", help="with --serve: serve with this command instead, an OpenAI-compatible "
                                                 "server ({python}, {model} and {port} filled in)")
    parser.add_argument("--image", help="with --serve: the image asked about (default: a drawn shape)")
    parser.add_argument("--serve-timeout", type=bounded(float, 1, 1e6), default=1200.0,
                        help="with --serve: seconds an engine may take to load and answer")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="No ccache found")
    if args.serve:
        return serve(args)
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


def serve(args) -> int:
    """``--serve``: each engine's answer beside this package's; 1 when one differs or none could be asked."""
    if not Path(args.serve).is_dir():
        print(f"doctor error: --serve {args.serve} is not a model folder", file=sys.stderr)
        return 2
    engines = args.engine or installed_engines()
    if not engines and not args.engine_command:
        print("no serving engine is installed here (vllm, sglang or fastdeploy; they need GPUs): nothing to serve "
              "with. python -m ernie_moe.export FOLDER --check says what each would do with the folder")
        return 1
    try:
        image = load_image(Path(args.image), 1 << 26) if args.image else drawn_shape()
    except (BadSample, OSError) as err:
        print(f"doctor error: --image: {err}", file=sys.stderr)
        return 2
    try:
        results = check_serving(args.serve, engines, image, args.engine_command, args.serve_timeout)
    except (CheckpointError, ConfigError, UsageError, ValueError) as err:
        print(f"doctor error: {err}", file=sys.stderr)
        return 2
    print("\n| engine | its answer | ours | largest log-probability difference | result |\n|---|---|---|---|---|")
    for r in results:
        difference = f"{r.logprob_difference:.3f}" if r.logprob_difference is not None else r.note or "-"
        print(f"| {r.engine} | {r.answer!r} | {r.ours!r} | {difference} | {'pass' if r.passed else 'FAIL'} |")
        if not r.answered:
            print(r.note, file=sys.stderr)
    return 0 if all(r.passed for r in results) else 1


def drawn_shape():
    """A shape of the default data, drawn: the question's image when none is given."""
    from ..data.formats.synthetic import SyntheticShapes

    shapes = SyntheticShapes(0, "eval", 1, 84)
    return shapes.draw(shapes.describe(0))


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
