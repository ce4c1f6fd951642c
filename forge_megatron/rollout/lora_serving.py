"""LoRA adapters served beside the base weights, as SGLang serves them (``--enable-lora``), for forge-engine; and the
names forge's weight sync gives the policy's adapters (``--weight-sync-lora adapter``).

SGLang's API, its field names:

    POST /load_lora_adapter   {lora_name, lora_path, pinned}  -> 200 {success, error_message, loaded_adapters}
    POST /unload_lora_adapter {lora_name}                     -> waits for the running requests that use it
    POST /generate            {..., lora_path: <lora_name>}   -> decoded with that adapter (absent: the base model)
    GET  /v1/models           the base model, then each adapter ({id, root, parent})

``lora_path`` is a PEFT adapter directory (``adapter_config.json`` + ``*.safetensors`` with
``base_model.model.<module>.lora_A.weight`` [R, I] and ``lora_B.weight`` [O, R]). A linear ``<module>`` of the served
model then computes y = x W^T + scaling * (x A^T) B^T, scaling = lora_alpha / R (lora_alpha / sqrt(R) with
``use_rslora``): PEFT's forward without dropout. What SGLang refuses is refused here too, so a misconfigured run
fails on the CPU as it would on the cluster: an adapter of rank above ``--max-lora-rank``, one adapting modules
outside ``--lora-target-modules``, a name already loaded, and forms neither serves here (DoRA, per-module ranks,
biases, embeddings). A module must be an ``nn.Linear`` of the served model (transformers >= 5 fuses a MoE layer's
routed experts into one tensor: they have no PEFT form).

Policy adapter names: ``forge-<run>-v<version>``: ``run`` a token per trainer run (a restarted trainer never
reuses a name the engines still hold from before), ``version`` the policy version whose weights base + adapter are.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (torch is imported where adapters are served: the gateway reads only the policy names)
    import torch

_POLICY_NAME = re.compile(r"forge-([0-9a-z]+)-v(\d+)")
NOT_LOADED = "The following requested LoRA adapters are not loaded"  # SGLang's answer to an unknown lora_path
_KEY = re.compile(r"base_model\.model\.(.+)\.(lora_A|lora_B)\.weight")
# the PEFT options whose non-default values change the forward (refused: nothing here computes them)
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "rank_pattern": {}, "alpha_pattern": {},
                "modules_to_save": None, "layer_replication": None}


def policy_adapter_name(run: str, version: int) -> str:
    """The engines' name of the policy adapter of ``version`` made by trainer run ``run``."""
    return f"forge-{run}-v{int(version)}"


def policy_adapter_version(name: str | None) -> int | None:
    """The policy version a :func:`policy_adapter_name` names; None for any other name."""
    m = _POLICY_NAME.fullmatch(name or "")
    return int(m.group(2)) if m else None


class AdapterError(ValueError):
    """An adapter that cannot be loaded or used; the message says why."""


@dataclass
class Adapter:
    name: str
    path: str
    scaling: float
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]  # served module name -> (A [R, I], B [O, R])


def read_peft_config(path: str) -> dict:
    """``adapter_config.json`` of the PEFT adapter directory ``path``."""
    if not os.path.isdir(path):
        raise AdapterError(f"lora_path {path!r} is not a directory (a PEFT adapter: adapter_config.json and "
                           "adapter_model.safetensors)")
    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{path}: cannot read adapter_config.json: {exc}") from None


def read_peft_factors(path: str) -> dict[str, dict[str, torch.Tensor]]:
    """{module: {lora_A, lora_B}} of the PEFT adapter directory ``path`` (every ``*.safetensors`` file in it)."""
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise AdapterError(f"{path} has no .safetensors file")
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for fname in files:
        for key, t in load_file(os.path.join(path, fname)).items():
            m = _KEY.fullmatch(key)
            if m is None:
                raise AdapterError(f"{path}/{fname}: {key!r} is not a LoRA factor of a linear "
                                   "(base_model.model.<module>.lora_A.weight / lora_B.weight)")
            modules.setdefault(m.group(1), {})[m.group(2)] = t
    return modules


class LoraServing:
    """The adapters an engine holds and the forward hooks that apply the active one.

    Every method runs on the engine's worker thread (the only thread that touches the model), so an adapter is
    never loaded, unloaded or switched inside a forward. ``using(adapter)`` makes ``adapter`` (None: the base model)
    the one the hooks add for the forwards in its block."""

    def __init__(self, model: torch.nn.Module, max_rank: int | None = None, target_modules=None, served_name=None):
        self.max_rank = max_rank
        self.targets = None if not target_modules or "all" in target_modules else set(target_modules)
        self.served_name = served_name or (lambda module: module)
        import torch

        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self.adapters: dict[str, Adapter] = {}
        self.active: Adapter | None = None
        self._hooked: set[str] = set()

    # --- load / unload ------------------------------------------------------------------------------------------
    def load(self, name: str, path: str) -> Adapter:
        if not isinstance(name, str) or not name:
            raise AdapterError("lora_name must be a non-empty string")
        if name in self.adapters:
            raise AdapterError(f"a LoRA adapter named {name!r} is already loaded (from "
                               f"{self.adapters[name].path}): unload it first or choose another name")
        config = read_peft_config(path)
        if config.get("peft_type", "LORA") != "LORA":
            raise AdapterError(f"{path}: peft_type {config.get('peft_type')!r}; only LORA adapters are served")
        for key, default in _UNSUPPORTED.items():
            if config.get(key, default) not in (default, None, {}, False):
                raise AdapterError(f"{path}: adapter_config {key}={config[key]!r} is not supported (plain LoRA only)")
        rank = config.get("r")
        if not isinstance(rank, int) or rank < 1:
            raise AdapterError(f"{path}: adapter_config r must be a positive int, got {rank!r}")
        if self.max_rank is not None and rank > self.max_rank:
            raise AdapterError(f"{path}: LoRA rank {rank} exceeds the server's --max-lora-rank {self.max_rank}")
        modules = read_peft_factors(path)
        alpha = float(config.get("lora_alpha", rank))
        scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        factors = {}
        for module, pair in sorted(modules.items()):
            served = self._served(path, module)
            factors[served] = self._checked(path, module, self.linears[served], pair, rank)
        if not factors:
            raise AdapterError(f"{path}: the adapter has no LoRA factors")
        adapter = Adapter(name=name, path=path, scaling=scaling, factors=factors)
        for module in factors:
            if module not in self._hooked:
                self.linears[module].register_forward_hook(self._hook(module))
                self._hooked.add(module)
        self.adapters[name] = adapter
        return adapter

    def _served(self, path: str, module: str) -> str:
        leaf = module.rsplit(".", 1)[-1]
        if self.targets is not None and leaf not in self.targets:
            raise AdapterError(f"{path}: the adapter adapts {leaf!r}, which is not among the server's "
                               f"--lora-target-modules ({', '.join(sorted(self.targets))})")
        for candidate in dict.fromkeys((module, self.served_name(module))):
            if candidate in self.linears:
                return candidate
        raise AdapterError(f"{path}: {module!r} is not a linear layer of the served model (a MoE layer's routed "
                           "experts are fused tensors, not linears: they have no LoRA form here)")

    @staticmethod
    def _checked(path: str, module: str, linear: torch.nn.Linear, pair: dict, rank: int):
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterError(f"{path}: {module} has {sorted(pair)}, needs lora_A and lora_B")
        A, B = pair["lora_A"], pair["lora_B"]
        want_A, want_B = (rank, linear.in_features), (linear.out_features, rank)
        if tuple(A.shape) != want_A or tuple(B.shape) != want_B:
            raise AdapterError(f"{path}: {module}'s lora_A {list(A.shape)} / lora_B {list(B.shape)} do not fit the "
                               f"linear ({linear.in_features} -> {linear.out_features}) at rank {rank}: expected "
                               f"{list(want_A)} / {list(want_B)}")
        dtype = linear.weight.dtype
        return A.to(dtype).contiguous(), B.to(dtype).contiguous()

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise AdapterError(f"no LoRA adapter named {name!r} is loaded (loaded: {sorted(self.adapters)})")
        del self.adapters[name]  # its hooks stay: they add nothing for modules the active adapter lacks

    def get(self, name) -> Adapter | None:
        """The adapter a request's ``lora_path`` names (None: the base model)."""
        if name is None:
            return None
        if not isinstance(name, str):
            raise AdapterError("lora_path must be the name of a loaded adapter (one per request here)")
        adapter = self.adapters.get(name)
        if adapter is None:  # (SGLang's words: the gateway's fleet tries another engine on them)
            raise AdapterError(f"{NOT_LOADED}: {name}; loaded adapters: {sorted(self.adapters) or 'none'} (load it "
                               "with /load_lora_adapter)")
        return adapter

    # --- the forward --------------------------------------------------------------------------------------------
    def _hook(self, module: str):
        def hook(linear, args, output):
            adapter = self.active
            if adapter is None:
                return None
            pair = adapter.factors.get(module)
            if pair is None:
                return None
            A, B = pair
            return output + adapter.scaling * ((args[0] @ A.T) @ B.T)
        return hook

    def using(self, adapter: Adapter | None):
        return _Active(self, adapter)


class _Active:
    def __init__(self, serving: LoraServing, adapter: Adapter | None):
        self.serving, self.adapter = serving, adapter

    def __enter__(self):
        self.serving.active = self.adapter

    def __exit__(self, *exc):
        self.serving.active = None
