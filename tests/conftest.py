import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "vl_moe.yaml")  # the default run's config
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from ernie_moe.parallel import cpu_fallbacks  # noqa: E402

cpu_fallbacks.use_avx2_math_on_amd()  # the trainer's math path, here and in every process a test launches

# the tests' runs keep the 8 rows a step they were sized for (the default trains on 16)
SMALL = ["data.image_size=56", "data.max_seq_len=48", "data.num_eval_samples=32", "logging.progress_bar=false",
         "training.per_device_train_batch_size=8"]
# the default run's batch and ViT rate before they were raised: the learning tests start from captioners trained
# so (the README's DPO, GRPO and EMA tables were measured with them)
EARLIER_DEFAULT = ["training.per_device_train_batch_size=8", "training.vit_lr_ratio=1"]


# Paddle's launcher picks a free port for its TCP store and binds it later: on a busy machine another process can
# take the port in between, and Paddle then aborts in libuv's cleanup with this message. The store is made before
# the trainer touches its output folder, so such a start simply runs again.
PORT_TAKEN = "uv__finish_close"


def run_launch(cmd, log_dir, **kwargs):
    """A ``paddle.distributed.launch`` command (``--log_dir log_dir``) through ``subprocess.run``, text captured; a
    start whose TCP store lost its port runs again, once."""
    log_dir = Path(log_dir)
    for attempt in range(2):
        result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
        logs = "".join(log.read_text(errors="replace") for log in sorted(log_dir.glob("workerlog.*")))
        if result.returncode == 0 or attempt or PORT_TAKEN not in result.stdout + result.stderr + logs:
            return result
        shutil.rmtree(log_dir, ignore_errors=True)


def launch(tmp_path, nproc, *overrides, name="run"):
    """``run_trainer.py`` on the default config under ``paddle.distributed.launch``: (output folder, log). One
    process runs the script itself, as ``python run_trainer.py`` does: the launcher adds nothing to it but a start."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    out, logs = tmp_path / name, tmp_path / f"{name}_log"
    trainer = [str(ROOT / "run_trainer.py"), "--config", CONFIG, f"training.output_dir={out}", *SMALL, *overrides]
    if nproc == 1:
        result = subprocess.run([sys.executable, *trainer], capture_output=True, text=True, cwd=tmp_path, env=env,
                                timeout=600)
        log = result.stderr
    else:
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc),
               "--log_dir", str(logs), *trainer]
        result = run_launch(cmd, logs, cwd=tmp_path, env=env, timeout=600)
        log = (logs / "workerlog.0").read_text() if logs.exists() else ""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:] + log[-3000:]
    return out, result.stdout + log


@pytest.fixture
def tiny_cfg():
    """The default config, shrunk for unit tests."""
    from ernie_moe.config import load_config

    return load_config(ROOT / "configs" / "vl_moe.yaml", [
        "data.image_size=56", "data.max_seq_len=48", "training.per_device_train_batch_size=2",
    ])


def drain(process, kept: list) -> None:
    """Keep a process's pipe drained; what it printed, once it closes, is appended to ``kept``."""
    kept.append(process.stdout.read())


def start(argv, cwd, marker: str, later: list | None = None):
    """A command that prints ``marker``'s line once it is ready: (process, that line's match); what it prints
    after that is appended to ``later``."""
    process = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
    seen = []
    for line in process.stdout:
        seen.append(line)
        found = re.search(marker, line)
        if found:
            kept = later if later is not None else []
            threading.Thread(target=drain, args=(process, kept), daemon=True).start()
            return process, found
    raise AssertionError("the command ended before it was ready:\n" + "".join(seen[-40:]))
