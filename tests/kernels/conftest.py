"""Kernel tests run Triton on CPU through its interpreter: TRITON_INTERPRET must be set before any @triton.jit
function is defined (i.e. before forge_megatron.kernels.tree_attention.triton_kernel is imported)."""

import os

from forge_megatron.utils import env

if not env.has_cuda():
    os.environ["TRITON_INTERPRET"] = "1"
