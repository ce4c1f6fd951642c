"""Megatron ``torch_dist`` checkpoints <-> the per-rank ``torch`` format, through Megatron's own dist_checkpointing.

``torch_dist`` stores every tensor once with its global shape, so it loads into any TP/PP/EP layout; Megatron writes
it collectively from a live model (``model.sharded_state_dict()``). This tool therefore runs as a job with one
process per rank of the layout (world size = tp * pp * ep; the EP ranks come from data parallelism, dp = ep; with
``--etp 1``, experts whole and the EP group spanning the TP ranks, pp * lcm(tp, ep)):

    torchrun --nproc-per-node 4 -m forge_megatron.convert.torch_dist to-torch-dist --mcore-dir CKPT --out DIST
    torchrun --nproc-per-node 2 -m forge_megatron.convert.torch_dist from-torch-dist --dist-dir DIST/ \\
        --hf-config MODEL_DIR --out CKPT2 --tp 2

``to-torch-dist`` reads a ``forge-convert`` checkpoint with its own layout and saves it as ``torch_dist``;
``from-torch-dist`` loads a ``torch_dist`` directory (ours, or a training checkpoint's ``iter_XXXXXXX``) into the
layout given (uneven pipeline stages too: ``--decoder-first/last-pipeline-num-layers``) and writes the ``torch``
format, which ``forge-convert mcore-to-hf`` turns into HF safetensors.
On CPU it runs on gloo; Megatron's writer needs ``psutil`` and starts helper processes, so the ranks must not be
daemonic processes (torchrun's are not).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from forge_megatron.bridge import Bridge, ParallelLayout
from forge_megatron.convert import checkpoint as ckpt


def _start(layout: ParallelLayout) -> None:
    from forge_megatron.mcore.parallel import ParallelConfig, initialize

    import torch.distributed as dist

    initialize(ParallelConfig(tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp,
                              first_stage_layers=layout.first, last_stage_layers=layout.last))
    want = world_size(layout)
    if dist.get_world_size() != want:
        raise ValueError(f"run with {want} processes for layout {layout} ({_world_rule(layout)}), got "
                         f"{dist.get_world_size()}")


def world_size(layout: ParallelLayout) -> int:
    """Processes that hold every shard of ``layout`` once: tp x pp x ep, or with expert TP 1 (the EP group spanning
    the TP ranks) pp x lcm(tp, ep)."""
    if layout.expert_tp == 1 and layout.tp > 1:
        return layout.pp * math.lcm(layout.tp, layout.ep)
    return layout.tp * layout.pp * layout.ep


def _world_rule(layout: ParallelLayout) -> str:
    return "pp*lcm(tp, ep) with etp 1" if layout.expert_tp == 1 and layout.tp > 1 else "tp*pp*ep"


def _build(bridge: Bridge):
    from forge_megatron.mcore.cpu_compat import cuda_factories_to_cpu
    from forge_megatron.mcore.model import build_gpt

    with cuda_factories_to_cpu():  # tied embeddings with PP > 1 move a copy with .cuda() on construction
        return build_gpt(bridge.cfg)


def _in_process_write_results() -> None:
    """Hand Megatron's torch_dist writer an in-process queue for its write results. By default it makes one through a
    ``multiprocessing`` Manager started with "spawn": a fresh interpreter per rank that imports this module again
    (torch with it) and then torch's checkpoint classes to unpickle the results, ~5 s of CPU a rank for nothing, since
    this converter saves synchronously (the writer puts its results and the saving rank takes them, one process).
    Megatron versions without that module attribute are left as they are."""
    import queue

    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    if hasattr(filesystem_async, "_results_queue") and filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def to_torch_dist(mcore_dir: str, out_dir: str) -> None:
    """Collective: save the ``torch`` checkpoint ``mcore_dir`` as ``torch_dist`` in ``out_dir``."""
    from megatron.core import dist_checkpointing

    from forge_megatron.mcore.cpu_compat import cuda_factories_to_cpu

    bridge, layout = ckpt.read_meta(mcore_dir)
    _start(layout)
    model = _build(bridge)
    ckpt.load_into(model, mcore_dir)
    os.makedirs(out_dir, exist_ok=True)
    _in_process_write_results()
    with cuda_factories_to_cpu():
        dist_checkpointing.save(model.sharded_state_dict(), out_dir)  # (synchronous: async_sharded_save False)


def from_torch_dist(dist_dir: str, hf_config: str, out_dir: str, layout: ParallelLayout) -> None:
    """Collective: load ``torch_dist`` ``dist_dir`` into ``layout`` and write it in the ``torch`` format."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from forge_megatron.mcore.cpu_compat import cuda_factories_to_cpu

    bridge = Bridge(hf_config)
    bridge.check_layout(layout)
    _start(layout)
    model = _build(bridge)
    with cuda_factories_to_cpu():
        state = dist_checkpointing.load(model.sharded_state_dict(), dist_dir)
    model.load_state_dict(state, strict=False)
    tp, pp, ep = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                  ps.get_expert_model_parallel_rank())
    ckpt.save_rank_state(bridge, layout, tp, pp, ep, model.state_dict(), out_dir)
    dist.barrier()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m forge_megatron.convert.torch_dist", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("to-torch-dist", help="forge-convert torch checkpoint -> torch_dist (world = tp*pp*ep; "
                                             "pp*lcm(tp, ep) with etp 1)")
    p.add_argument("--mcore-dir", required=True)
    p.add_argument("--out", required=True)
    p = sub.add_parser("from-torch-dist", help="torch_dist -> torch checkpoint with --tp/--pp/--ep/--etp (world = "
                                               "tp*pp*ep; pp*lcm(tp, ep) with --etp 1)")
    p.add_argument("--dist-dir", required=True, help="directory with .metadata and *.distcp files")
    p.add_argument("--hf-config", required=True, help="HF model directory or config.json describing the model")
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=None, help="expert TP of the output: TP (default) or 1 (world = "
                                                           "pp*lcm(tp, ep))")
    p.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None, metavar="N",
                   help="uneven pipeline stages of the output: the first stage's layers (Megatron-LM's flag)")
    p.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None, metavar="N",
                   help="and the last stage's (the others share the rest evenly)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from forge_megatron.mcore.parallel import destroy

    args = build_parser().parse_args(argv)
    try:
        if args.command == "to-torch-dist":
            to_torch_dist(args.mcore_dir, args.out)
        else:
            layout = ParallelLayout(args.tp, args.pp, args.ep, args.etp, first=args.decoder_first_pipeline_num_layers,
                                    last=args.decoder_last_pipeline_num_layers)
            from_torch_dist(args.dist_dir, args.hf_config, args.out, layout)
    finally:
        destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
