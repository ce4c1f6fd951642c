"""Build and install forge_megatron.

Two compiled extensions, both optional at run time (pure-Python / Triton fallbacks exist):
  forge_megatron._C_tree       C++ prefix-tree builder (pybind11, CPU). Built everywhere a C++17 compiler exists.
  forge_megatron._C_tree_attn  CUDA tree attention (csrc/tree_attn). Built only with a CUDA build of torch and nvcc.

Environment:
  FORGE_SKIP_CUDA_BUILD=1      never build the CUDA extension
  FORGE_SKIP_CPP_BUILD=1       never build the C++ tree builder (the Python builder is used)
  FORGE_CUDA_ARCH_LIST="9.0"   CUDA targets (semicolon separated, like TORCH_CUDA_ARCH_LIST; "9.0a" for wgmma)

Install with ``pip install --no-build-isolation -e .`` after torch: build isolation would fetch a CUDA torch.
"""

import glob
import os
import shutil

from setuptools import Extension, find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _cpp_tree_ext():
    if os.environ.get("FORGE_SKIP_CPP_BUILD") == "1":
        return []
    sources = sorted(glob.glob(os.path.join("csrc", "tree", "*.cpp")))
    if not sources:
        return []
    try:
        import pybind11
    except ImportError:
        print("forge_megatron: pybind11 missing, skipping the C++ tree builder (Python fallback is used)")
        return []
    return [
        Extension(
            "forge_megatron._C_tree",
            sources=sources,
            include_dirs=[pybind11.get_include()],
            language="c++",
            extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden"],
        )
    ]


def _cuda_ext():
    if os.environ.get("FORGE_SKIP_CUDA_BUILD") == "1":
        return [], {}
    sources = sorted(glob.glob(os.path.join("csrc", "tree_attn", "*.cu")) + glob.glob(os.path.join("csrc", "tree_attn", "*.cpp")))
    if not sources:
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension
    except ImportError:
        return [], {}
    if torch.version.cuda is None or not (shutil.which("nvcc") or os.environ.get("CUDA_HOME")):
        print("forge_megatron: no CUDA torch or nvcc, skipping the CUDA tree-attention extension")
        return [], {}
    archs = os.environ.get("FORGE_CUDA_ARCH_LIST", "9.0").replace(",", ";").split(";")
    gencode = []
    for arch in filter(None, (a.strip() for a in archs)):
        num = arch.replace(".", "")
        gencode += ["-gencode", f"arch=compute_{num},code=sm_{num}"]
    ext = CUDAExtension(
        "forge_megatron._C_tree_attn",
        sources=sources,
        extra_compile_args={
            "cxx": ["-O3", "-std=c++17"],
            "nvcc": ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo", *gencode],
        },
    )
    return [ext], {"build_ext": BuildExtension}


cuda_exts, cmdclass = _cuda_ext()

setup(
    name="forge_megatron",
    version="0.1.0",
    description="Agent RL on Megatron-Core: gateway, windowed-FIFO data pool, prefix-tree training, CISPO, MoE weight sync",
    python_requires=">=3.11",
    packages=find_packages(include=["forge_megatron", "forge_megatron.*"]),
    package_data={"forge_megatron": ["assets/**/*"]},
    include_package_data=True,
    ext_modules=_cpp_tree_ext() + cuda_exts,
    cmdclass=cmdclass,
    install_requires=[
        # CPU machines: install torch==2.13.0 first (the scripts do); GPU machines bring their CUDA torch.
        "torch>=2.4",
        "megatron-core>=0.16.1",
        "pyzmq>=25",
        "msgpack>=1.0",
        "safetensors>=0.4",
        "transformers>=4.45",
        "numpy>=1.24",
        "aiohttp>=3.9",
        "tqdm",
        "psutil",  # megatron.core.dist_checkpointing (torch_dist) writer
        "accelerate",  # transformers loads FP8 checkpoints (forge-engine serving one) only with it
        "pillow>=9",  # images of vision-language agents (gateway, engine, trainer: multimodal/images.py)
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist>=3.5", "triton>=3.0", "openai>=1.0", "anthropic>=0.40",
                 "pybind11>=2.12", "matplotlib",
                 "compressed-tensors",  # the reference for int4-to-bf16's dequantisation
                 "peft"],  # loads trainer-to-peft's LoRA adapters in the tests
        "gpu": ["transformer-engine[pytorch]"],
    },
    entry_points={
        "console_scripts": [
            "forge-env=forge_megatron.utils.env:main",
            "forge-engine=forge_megatron.rollout.engine_server:main",
            "forge-gateway=forge_megatron.middleware.gateway:main",
            "forge-pool=forge_megatron.middleware.pool_server:main",
            "forge-pool-export=forge_megatron.middleware.pool_export:main",
            "forge-convert=forge_megatron.convert.cli:main",
            "forge-node=forge_megatron.agents.middleware_node:main",
            "forge-rollout=forge_megatron.agents.driver:main",
            "forge-eval=forge_megatron.agents.evaluate:main",
            "forge-sft=forge_megatron.training.sft:main",
            "forge-rm=forge_megatron.training.preference:main_rm",
            "forge-dpo=forge_megatron.training.preference:main_dpo",
            "forge-kto=forge_megatron.training.kto:main",
            "forge-plan=forge_megatron.training.plan:main",
        ]
    },
)
