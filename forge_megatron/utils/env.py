"""The one place that decides what this machine can do.

Every optional backend (CUDA, Triton, Transformer Engine, NVIDIA apex, our compiled extensions) is
probed here, lazily and once, so no device query or heavy import happens at ``import forge_megatron``.
Other modules ask ``env.has_cuda()`` etc. and call :func:`require` to fail with a message that says how
to get a missing piece.

Transformer Engine is the awkward one: on machines without cuDNN ``import transformer_engine`` raises
``RuntimeError`` (not ``ImportError``), so every probe catches ``Exception``.
"""

from __future__ import annotations

import functools
import importlib
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass

__all__ = [
    "has_cuda", "describe_cuda", "has_triton", "has_te", "has_apex", "has_tree_ext", "has_cuda_ext", "has_nvcc",
    "mcore_version", "mcore_version_tuple", "require", "report", "Probe",
]


@dataclass(frozen=True)
class Probe:
    """Result of probing one optional component."""

    available: bool
    version: str | None = None
    detail: str = ""


def _import_probe(module: str) -> Probe:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - TE raises RuntimeError when cuDNN is missing
        return Probe(False, None, f"{type(exc).__name__}: {exc}".splitlines()[0][:200])
    return Probe(True, getattr(mod, "__version__", None))


@functools.cache
def probe_cuda() -> Probe:
    """Whether this process can use a CUDA device, asked without initialising CUDA here: a process that has (through
    torch.cuda.get_device_name, say) can no longer fork children that use CUDA ("Cannot re-initialize CUDA in forked
    subprocess", seen on an H200 when the test ranks' fork server probed this way), and neither can one whose CUDA
    runtime answered torch.cuda.is_available(). torch.cuda.device_count() asks NVML where the driver has it (and
    honours CUDA_VISIBLE_DEVICES); :func:`describe_cuda` names the devices, initialising CUDA."""
    import torch

    if torch.version.cuda is None:
        return Probe(False, None, "this torch is a CPU build")
    count = torch.cuda.device_count()
    if count == 0:
        return Probe(False, torch.version.cuda, "no CUDA device visible (torch.cuda.device_count() is 0)")
    return Probe(True, torch.version.cuda, f"{count} device(s)")


def describe_cuda() -> str:
    """'<count> x <names>' of the visible CUDA devices ('' without any). Initialises CUDA in this process: for
    reports and benchmarks, not for processes that fork workers afterwards."""
    if not has_cuda():
        return ""
    import torch

    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    return f"{torch.cuda.device_count()} x {', '.join(names)}"


@functools.cache
def probe_triton() -> Probe:
    return _import_probe("triton")


@functools.cache
def probe_te() -> Probe:
    return _import_probe("transformer_engine")


@functools.cache
def probe_apex() -> Probe:
    # PyPI's "apex" is an unrelated web toolkit: NVIDIA apex has apex.normalization.
    return _import_probe("apex.normalization")


@functools.cache
def probe_tree_ext() -> Probe:
    """The C++ prefix-tree builder (``forge_megatron._C_tree``), built by setup.py on every machine."""
    return _import_probe("forge_megatron._C_tree")


@functools.cache
def probe_cuda_ext() -> Probe:
    """The CUDA tree-attention extension (``forge_megatron._C_tree_attn``), built only with CUDA + nvcc."""
    return _import_probe("forge_megatron._C_tree_attn")


@functools.cache
def probe_mcore() -> Probe:
    try:
        from importlib.metadata import version

        v = version("megatron-core")
    except Exception as exc:  # noqa: BLE001
        return Probe(False, None, str(exc))
    return Probe(True, v)


@functools.cache
def probe_nvcc() -> Probe:
    nvcc = shutil.which("nvcc") or (
        os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if "CUDA_HOME" in os.environ else None
    )
    if not nvcc or not os.path.exists(nvcc):
        for cand in ("/usr/local/cuda/bin/nvcc",):
            if os.path.exists(cand):
                nvcc = cand
                break
        else:
            return Probe(False, None, "nvcc not on PATH, CUDA_HOME unset")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except Exception as exc:  # noqa: BLE001
        return Probe(False, None, str(exc))
    ver = out.strip().splitlines()[-1] if out.strip() else ""
    return Probe(True, ver, nvcc)


def has_cuda() -> bool:
    return probe_cuda().available


def has_triton() -> bool:
    return probe_triton().available


def has_te() -> bool:
    return probe_te().available


def has_apex() -> bool:
    return probe_apex().available


def has_tree_ext() -> bool:
    return probe_tree_ext().available


def has_cuda_ext() -> bool:
    return probe_cuda_ext().available


def has_nvcc() -> bool:
    return probe_nvcc().available


def nvcc_path() -> str | None:
    p = probe_nvcc()
    return p.detail if p.available else None


def mcore_version() -> str | None:
    return probe_mcore().version


def mcore_version_tuple() -> tuple[int, ...]:
    v = mcore_version()
    if v is None:
        return (0,)
    parts = []
    for tok in v.split(".")[:3]:
        digits = "".join(ch for ch in tok if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


_HOW_TO_GET = {
    "cuda": "a CUDA build of torch and an NVIDIA GPU (see docs/development.md, 'GPU install')",
    "triton": "pip install triton  (CPU tests run it with TRITON_INTERPRET=1)",
    "te": "pip install transformer-engine[pytorch]  (GPU machines with CUDA and cuDNN only)",
    "apex": "build NVIDIA apex from source (github NVIDIA/apex); PyPI's 'apex' is unrelated",
    "tree_ext": "pip install -e .  (builds forge_megatron._C_tree with the system C++ compiler)",
    "cuda_ext": "pip install -e . on a machine with CUDA torch and nvcc (FORGE_CUDA_ARCH_LIST selects archs)",
    "mcore": "pip install megatron-core==0.16.1  (Python 3.11; 0.17+ needs Python 3.12)",
    "nvcc": "install the CUDA toolkit and put nvcc on PATH (or set CUDA_HOME)",
}

_PROBES = {
    "cuda": probe_cuda, "triton": probe_triton, "te": probe_te, "apex": probe_apex,
    "tree_ext": probe_tree_ext, "cuda_ext": probe_cuda_ext, "mcore": probe_mcore, "nvcc": probe_nvcc,
}


def require(name: str, purpose: str = "") -> None:
    """Raise a RuntimeError that says how to get ``name`` if it is unavailable."""
    probe = _PROBES[name]()
    if not probe.available:
        why = f" (needed for {purpose})" if purpose else ""
        raise RuntimeError(
            f"{name} is not available{why}: {probe.detail or 'not installed'}. To get it: {_HOW_TO_GET[name]}"
        )


def report() -> str:
    """A human-readable report of the environment, like ``torch.utils.collect_env``."""
    import torch

    lines = [
        "forge_megatron environment",
        f"  python              : {sys.version.split()[0]} ({platform.platform()})",
        f"  torch               : {torch.__version__} (cuda build: {torch.version.cuda})",
    ]
    labels = {
        "mcore": "megatron-core", "cuda": "CUDA device", "triton": "triton", "te": "transformer-engine",
        "apex": "NVIDIA apex", "tree_ext": "C++ tree builder", "cuda_ext": "CUDA tree attention",
        "nvcc": "nvcc",
    }
    for key, label in labels.items():
        p = _PROBES[key]()
        state = "yes" if p.available else "no"
        extra = " ".join(x for x in (p.version or "", "" if p.available else f"[{p.detail}]") if x)
        if key == "cuda" and p.available:
            extra = f"{extra} ({describe_cuda()})"
        lines.append(f"  {label:<20}: {state} {extra}".rstrip())
    lines.append(f"  TRITON_INTERPRET    : {os.environ.get('TRITON_INTERPRET', '0')}")
    lines.append(f"  FORGE_TREE_ATTN_BACKEND: {os.environ.get('FORGE_TREE_ATTN_BACKEND', '(auto)')}")
    lines.append(f"  FORGE_TREE_ATTN_TRITON_TILES: {os.environ.get('FORGE_TREE_ATTN_TRITON_TILES', '(defaults)')}")
    lines.append(f"  FORGE_TREE_ATTN_DKDV_SPLIT: {os.environ.get('FORGE_TREE_ATTN_DKDV_SPLIT', '0 (off)')}")
    lines.append(f"  FORGE_TREE_ATTN_SPLIT_HEAD: {os.environ.get('FORGE_TREE_ATTN_SPLIT_HEAD', '0 (off)')}")
    lines.append(f"  FORGE_GDN_BACKEND   : {os.environ.get('FORGE_GDN_BACKEND', '(auto)')}")
    return "\n".join(lines)


def main() -> None:
    print(report())
