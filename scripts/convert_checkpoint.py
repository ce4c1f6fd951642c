#!/usr/bin/env python
"""Convert checkpoints between HF safetensors and Megatron-Core (same as the ``forge-convert`` command).

    python scripts/convert_checkpoint.py hf-to-mcore --hf-dir MODEL --out CKPT --tp 2 --pp 2
    python scripts/convert_checkpoint.py mcore-to-hf --mcore-dir CKPT --out MODEL_OUT
    python scripts/convert_checkpoint.py reshard --mcore-dir CKPT --out CKPT2 --tp 1 --ep 2
"""

import sys

from forge_megatron.convert.cli import main

if __name__ == "__main__":
    sys.exit(main())
