"""The last module the ranks' server preloads (tests/dist_utils.py: PRELOAD): it freezes the heap the server
imported (``gc.freeze``), so a forked rank's collections never walk the millions of objects of torch, Megatron-Core
and transformers (nor touch, and so copy, their pages)."""

import gc

gc.freeze()
