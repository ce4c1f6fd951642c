"""Shared test configuration.

Markers: ``gpu`` (needs one CUDA device) and ``multigpu`` (needs two or more) are skipped without them.
Multi-rank Megatron tests use :func:`tests.dist_utils.run_distributed` (gloo, processes forked from a server that
imported torch and Megatron once); whole programs' ranks :func:`tests.dist_utils.run_script`.
"""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Triton kernels run under the interpreter on CPU machines. It must be set before any @triton.jit function is
# defined, i.e. before any test module (of any directory) imports forge_megatron.kernels.tree_attention.triton_kernel.
from forge_megatron.utils import env as _env  # noqa: E402

if not _env.has_cuda():
    os.environ["TRITON_INTERPRET"] = "1"


def _patch_the_language_once() -> None:
    """Triton's interpreter patches the ``triton.language`` modules a ``@triton.jit`` function's globals hold (its
    builtins replaced by the interpreter's) at every call of a jit helper from inside a kernel, never restoring them
    (a launch restores only its own patches): ``inspect.getmembers`` over those modules each time, though after
    the first call they are patched already and the patching changes nothing. That was ~20 % of the kernel tests'
    time. Here such a call skips the patching when every language module in the helper's globals is patched
    already (its ``full`` no longer a builtin); everything else is Triton's own. Left alone where Triton's
    interpreter does not look like this."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch, scope = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    is_builtin = getattr(tl.core, "is_builtin", None)
    if patch is None or scope is None or is_builtin is None or not all(
            is_builtin(getattr(m, "full", None)) for m in (tl, tl.core)):
        return

    def patch_lang(fn):
        langs = [value for value in fn.__globals__.values() if value is tl or value is tl.core]
        if langs and not any(is_builtin(m.full) for m in langs):  # patched already: nothing would change
            return scope()
        return patch(fn)

    interpreter._patch_lang = patch_lang


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_language_once()


def pytest_collection_modifyitems(config, items):
    from forge_megatron.utils import env

    n_gpus = 0
    if env.has_cuda():
        import torch

        n_gpus = torch.cuda.device_count()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs 2+ CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and n_gpus < 1:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and n_gpus < 2:
            item.add_marker(skip_multi)


def pytest_collection_finish(session):
    """The heap the test modules imported (torch, Megatron-Core, transformers, the test cases) is frozen
    (``gc.freeze``): the collector's full passes during the tests walk only what the tests make (as the ranks' server
    does: tests/dist_freeze.py). What a test frees and collects is made by the test, so nothing it waits for is kept."""
    import gc

    gc.freeze()


def pytest_sessionfinish(session, exitstatus):
    """Unfrozen for the interpreter's exit, which then frees it as usual (frozen, Triton's IR objects were reported
    leaked by nanobind at exit)."""
    import gc

    gc.unfreeze()


def pytest_runtest_logreport(report):
    """FORGE_TEST_FAILURE_LOG=FILE: each failure's report is appended to FILE as it happens (benchmarks/gpu_check.sh:
    a run cut short by a time limit, or a worker killed by a crash, still leaves the failures seen so far; pytest's
    own summary only comes at the end). Under pytest-xdist the controller receives every worker's reports."""
    path = os.environ.get("FORGE_TEST_FAILURE_LOG")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):  # a worker's reach the controller
        return
    with open(path, "a") as f:
        f.write(f"===== FAILED {report.nodeid} ({report.when}, {report.duration:.1f}s)\n{report.longreprtext}\n\n")
