"""LoRA runs in this process over the default model, and the model folder they start from."""

import numpy as np
import paddle

from ernie_moe.config import load_config
from ernie_moe.training import Trainer
from support.runs import ROOT

SMALL = ["data.image_size=56", "data.max_seq_len=48", "training.per_device_train_batch_size=2",
         "logging.visualdl=false", "training.eval_steps=0", "data.num_eval_samples=8", "training.max_steps=3",
         "logging.logging_steps=1", "training.learning_rate=1e-2", "logging.progress_bar=false"]


def trainer(tmp_path, *overrides) -> Trainer:
    return Trainer(load_config(ROOT / "configs" / "vl_moe.yaml", [*SMALL, f"training.output_dir={tmp_path}",
                                                                    *overrides]))


def lora(tmp_path, base, *overrides) -> Trainer:
    return trainer(tmp_path, "training.fine_tuning=lora", f"training.model_name_or_path={base}", *overrides)


def logits(tr, batch) -> np.ndarray:
    tr.parts.model.eval()
    with paddle.no_grad():
        out = tr.parts.model(batch, return_logits=True).logits.numpy()
    tr.parts.model.train()
    return out
