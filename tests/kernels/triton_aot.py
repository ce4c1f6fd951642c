"""Compile the Triton tree-attention kernels ahead of time for an NVIDIA target (default sm_90), with no GPU.

Run as a script in a process WITHOUT TRITON_INTERPRET (the interpreter replaces @triton.jit functions): it lowers
every kernel through Triton's full pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin via the bundled ptxas), so code
that only the GPU path exercises (native fp16/bf16 tl.dot, input_precision, scf.if around dots) is checked on CPU
machines. Prints one line per kernel: dtype, head dim, name, shared memory bytes, its tiles (BLOCK_MxBLOCK_NxWARPSx
STAGES; FORGE_TREE_ATTN_TRITON_TILES overrides them as in the kernels), and with --resources the
registers per thread and the stack bytes per thread that ptxas gave it (spills; read from the cubin with the cuobjdump
Triton ships).

  python tests/kernels/triton_aot.py [--arch 90] [--dtypes bf16 fp32] [--head-dims 64 128 192x128 512] [--key-end]
      [--dkdv-split] [--resources]
  python tests/kernels/triton_aot.py --batch FILE   # FILE: JSON {"name": {"argv": [...], "env": {...}}, ...}

--batch compiles several such runs in one process (the tests' ~4 s of imports paid once): each run's lines are
prefixed with its name, and a run that fails prints ``NAME ! ERROR`` and its traceback's lines instead.

A head dim ``HxHV`` compiles query/key heads of H channels with value heads of HV (multi-latent attention).
"""

from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from forge_megatron.kernels.tree_attention import triton_kernel as tk

TENSOR_ARGS = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV"}
INT_POINTER_ARGS = {"SUB_END", "DEPTH", "KEY_END", "F_OFF", "F_LO", "F_HI", "P_OFF", "P_LO", "P_HI"}
FP32_POINTER_ARGS = {"LSE", "DELTA", "SINKS"}
FLOAT_ARGS = {"qk_scale", "scale"}
COMPUTE = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}


def signature(fn, dtype: str, constexprs: dict) -> dict:
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ("DK", "DV") and constexprs.get("SPLIT"):  # the fp32 sums the query heads add into
            sig[name] = "*fp32"
        elif name in TENSOR_ARGS:
            sig[name] = f"*{dtype}"
        elif name in INT_POINTER_ARGS:
            sig[name] = "*i32"
        elif name in FP32_POINTER_ARGS:
            sig[name] = "*fp32"
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def specialisation(fn, constexprs: dict, aligned_ints: set[str]) -> dict:
    """What Triton's JIT assumes at a launch whose pointers are 16-byte aligned and whose ``aligned_ints`` are
    multiples of 16 (tt.divisibility = 16): without it loads compile to 2-byte scalar accesses that never pipeline,
    and the registers, shared memory and spills printed would not be the launched kernel's."""
    names = [name for name in inspect.signature(fn.fn).parameters if name not in constexprs]
    pointers = TENSOR_ARGS | INT_POINTER_ARGS | FP32_POINTER_ARGS
    return {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in names
            if name in pointers or name in aligned_ints}


def compile_kernel(fn, dtype: str, constexprs: dict, arch: int, options: dict, aligned_ints: set[str] = frozenset()):
    src = ASTSource(fn=fn, signature=signature(fn, dtype, constexprs), constexprs=constexprs,
                    attrs=specialisation(fn, constexprs, aligned_ints))
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def resources(kernel) -> str:
    """'regs=R stack=S' of a compiled kernel: ptxas' registers per thread and stack (spill) bytes per thread."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    usage = dict(field.split(":", 1) for line in out.splitlines() if "REG:" in line for field in line.split())
    return f"regs={usage['REG']} stack={usage['STACK']}"


def compile_gated_delta(shapes: list[str], arch: int) -> list[str]:
    from forge_megatron.kernels import gated_delta_triton as gt

    lines = []
    for shape in shapes:  # DKxDVxC[r|p][/BV]: r, a decay per key channel (Kimi Delta Attention's PER_ROW); p, the plain
        # rule (Mamba-2: no correction term, HAS_W off); BV, the value block a launch of few programs narrows to
        shape, _, narrow = shape.partition("/")
        per_row, plain = shape.endswith("r"), shape.endswith("p")
        dk, dv, chunk = (int(x) for x in shape.removesuffix("r").removesuffix("p").split("x"))
        bk, bv = gt.blocks(dk, dv)
        bv = int(narrow) if narrow else bv
        for fn, flag in ((gt._scan_fwd_kernel, "HAS_S0"), (gt._scan_bwd_kernel, "HAS_DS_FINAL")):
            constexprs = dict(C=chunk, BK=bk, BV=bv, PRECISION="ieee", PER_ROW=per_row, HAS_W=not plain,
                              **{flag: True})
            sig = {name: "constexpr" if name in constexprs else "i32" if name in ("n_chunks", "dk", "dv") else "*fp32"
                   for name in inspect.signature(fn.fn).parameters}
            # as the JIT specialises a launch: 16-byte aligned tensors, and dk / dv multiples of 16 when they are
            attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in sig.items()
                     if kind == "*fp32" or (name == "dk" and dk % 16 == 0) or (name == "dv" and dv % 16 == 0)}
            src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
            kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                    options=gt.launch_options(bk, bv))
            lines.append(f"fp32 {shape}{'/' + narrow if narrow else ''} {fn.fn.__name__} "
                         f"shared={kernel.metadata.shared}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp16", "fp32"], choices=sorted(COMPUTE))
    p.add_argument("--head-dims", nargs="+", default=["64", "128"], help="H, or HxHV for value heads of HV")
    p.add_argument("--sinks-window", type=int, default=None, metavar="W",
                   help="compile the variants with attention sinks and a sliding window of W (gpt-oss)")
    p.add_argument("--key-end", action="store_true",
                   help="compile the variants with bidirectional blocks (key_end: Gemma 3's images)")
    p.add_argument("--softcap", type=float, default=0.0, metavar="C",
                   help="compile the variants with scores soft-capped at C (Gemma 2's attn_logit_softcapping)")
    p.add_argument("--chunk", type=int, default=0, metavar="C",
                   help="compile the variants with chunked attention of C positions (Llama 4's attention_chunk_size)")
    p.add_argument("--dkdv-split", action="store_true",
                   help="compile dK/dV with one program per query head (fp32 atomics; FORGE_TREE_ATTN_DKDV_SPLIT=1)")
    p.add_argument("--resources", action="store_true",
                   help="also print each kernel's registers and stack (spill) bytes per thread")
    p.add_argument("--gated-delta", nargs="+", default=None, metavar="DKxDVxC",
                   help="instead: the gated delta rule's scan kernels (kernels/gated_delta_triton.py) for key dim DK, "
                        "value dim DV and chunk C (fp32), e.g. 128x128x64")
    p.add_argument("--batch", default=None, metavar="FILE",
                   help="instead: the runs named in this JSON file, {name: {argv: [...], env: {...}}}, in one process")
    return p


def run_batch(path: str) -> None:
    import json
    import traceback

    with open(path) as f:
        runs = json.load(f)
    for name, run in runs.items():
        saved = {k: os.environ.get(k) for k in run.get("env", {})}
        os.environ.update(run.get("env", {}))
        try:
            lines = compile_run(build_parser().parse_args(run["argv"]))
        except BaseException:  # noqa: BLE001 - reported under the run's name, the others still compiled
            lines = ["! ERROR", *(f"! {line}" for line in traceback.format_exc().splitlines())]
        finally:  # the environment as it was, for the next run
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
        for line in lines:
            print(f"{name} {line}", flush=True)


def compile_run(args) -> list[str]:
    """The output lines of one run (its parsed arguments)."""
    if args.gated_delta:
        return compile_gated_delta(args.gated_delta, args.arch)
    lines = []
    for dtype in args.dtypes:
        for dims in args.head_dims:
            H, _, HV = dims.partition("x")
            cfg = tk.gpu_launch_config(int(H), COMPUTE[dtype], int(HV) if HV else None)
            window = args.sinks_window or 0
            for name, fn in (("fwd", tk._fwd_kernel), ("dq", tk._bwd_dq_kernel), ("dkdv", tk._bwd_dkdv_kernel)):
                tile_constexprs, options = tk._kernel_launch(cfg, name)
                extra = dict(HAS_SINKS=window > 0) if fn is tk._fwd_kernel else \
                    dict(SPLIT=args.dkdv_split or tk.dkdv_split()) if fn is tk._bwd_dkdv_kernel else {}
                constexprs = dict(GROUP=4, WINDOW=window, HAS_KEY_END=args.key_end, SOFTCAP=args.softcap * tk.LOG2E,
                                  CHUNK=args.chunk,
                                  **extra, **tile_constexprs)
                # strides are multiples of the head dims (tokens x heads x channels, contiguous): 16-aligned with them
                aligned = {n for n in inspect.signature(fn.fn).parameters if n.startswith("stride_")} \
                    if int(H) % 16 == 0 and int(HV or H) % 16 == 0 else set()
                aligned |= {n for n, d in (("H", H), ("HV", HV or H)) if int(d) % 16 == 0}
                kernel = compile_kernel(fn, dtype, constexprs, args.arch, options, aligned)
                usage = f" {resources(kernel)}" if args.resources else ""
                tiles = "x".join(str(x) for x in cfg["tiles"][name])
                lines.append(f"{dtype} {dims} {fn.fn.__name__} shared={kernel.metadata.shared} tiles={tiles}{usage}")
    return lines


def main() -> None:
    args = build_parser().parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter cannot compile kernels for a GPU target")
    if args.batch:
        run_batch(args.batch)
        return
    for line in compile_run(args):
        print(line)


if __name__ == "__main__":
    main()
