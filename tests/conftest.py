import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from ernie_moe.parallel import cpu_fallbacks  # noqa: E402

cpu_fallbacks.use_avx2_math_on_amd()  # the trainer's math path, here and in every process a test launches


@pytest.fixture
def tiny_cfg():
    """The default config, shrunk for unit tests."""
    from ernie_moe.config import load_config

    return load_config(ROOT / "configs" / "vl_moe.yaml", [
        "data.image_size=56", "data.max_seq_len=48", "training.per_device_train_batch_size=2",
    ])
