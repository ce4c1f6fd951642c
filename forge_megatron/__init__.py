"""forge_megatron: agent reinforcement learning on Megatron-Core.

Layers (lower never imports higher):
  utils <- tree, kernels, algo <- mcore <- training
  bridge <- weight_sync, convert
  middleware, rollout stand apart from Megatron.
"""

import os as _os
import warnings as _warnings

__version__ = "0.1.0"

# On a machine without an NVIDIA GPU, Transformer Engine and Apex cannot be there: Megatron-Core's import-time
# warnings that they are not installed (seven per process) say nothing there, so they are not shown. On a GPU
# machine they are (there they are worth knowing).
if not _os.path.exists("/dev/nvidiactl") and not _os.path.exists("/proc/driver/nvidia"):
    for _message in (r"Transformer Engine and Apex are not installed", r"Apex is not installed"):
        _warnings.filterwarnings("ignore", message=_message, category=UserWarning)
