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
#
# There, too, Megatron's import-time ``torch.compile`` calls are deferred (cpu_compat patch 8: 1.8 s of every
# process that imports Megatron): a one-shot import hook installs the lazy torch.compile just before Megatron's
# ``megatron.core.jit`` binds it, and only if Megatron is imported at all.
if not _os.path.exists("/dev/nvidiactl") and not _os.path.exists("/proc/driver/nvidia"):
    for _message in (r"Transformer Engine and Apex are not installed", r"Apex is not installed"):
        _warnings.filterwarnings("ignore", message=_message, category=UserWarning)

    import sys as _sys

    class _DeferCompileBeforeMegatron:
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name == "megatron.core.jit":
                _sys.meta_path.remove(cls)
                from forge_megatron.mcore.cpu_compat import defer_torch_compile

                defer_torch_compile()
            return None  # the usual finders import the module

    if "megatron.core.jit" not in _sys.modules:
        _sys.meta_path.insert(0, _DeferCompileBeforeMegatron)
