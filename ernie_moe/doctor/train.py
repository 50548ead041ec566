"""The trainer the doctor's layout runs launch: ``train.py section.key=value ...`` on the built-in defaults."""

import sys

from ernie_moe.config import load_config
from ernie_moe.training import Trainer

if __name__ == "__main__":
    Trainer(load_config(None, sys.argv[1:])).train()
