"""forge-engine: a CPU reference inference engine that speaks SGLang's HTTP API.

Tests and the demo need an engine that generates for real (tokens and logprobs come from the weights) and whose
weights can be swapped by the trainer, without a GPU or SGLang. This server loads a HF causal LM from a local
directory (transformers, fp32) and serves the subset of SGLang's native API that forge uses, with SGLang's field
names: ``/generate`` (``input_ids``, ``sampling_params``, ``return_logprob``, ``top_logprobs_num``,
``logprob_start_len``: the input's logprobs as ``meta_info["input_token_logprobs"]``, and with ``top_logprobs_num``
each input position's most likely tokens as ``meta_info["input_top_logprobs"]``; with ``max_new_tokens: 0`` a
prefill-only scoring, what a distillation teacher is asked; ``stream``,
``image_data`` for Qwen3-VL / Qwen3.5 / GLM-4.xV / Gemma 3 / Gemma 4 / Mistral 3 / Kimi-K2.5 models: inline images,
one placeholder per image in ``input_ids``, written out here as SGLang's processors do: multimodal/images.py
``ImageProcessor.engine_ids``), ``/health``, ``/get_model_info``, ``/get_weight_version``, ``/flush_cache``,
``/pause_generation`` (mode abort|in_place|retract),
``/continue_generation``, ``/update_weights_from_disk``, ``/init_weights_update_group``,
``/update_weights_from_distributed``; with ``--enable-lora`` SGLang's LoRA serving: ``/load_lora_adapter``,
``/unload_lora_adapter``, ``/generate``'s ``lora_path``, adapters listed by ``/v1/models`` (see lora_serving.py);
OpenAI's ``/v1/chat/completions`` for text (the chat template rendered, as SGLang's does; what an LLM judge,
agents/judge.py, asks).

Decoding: every request decodes token by token with its own KV cache. Each forward step is a
job on one worker thread, so concurrent requests interleave step by step and a weight update (also a job on that
thread) always lands between two steps, never inside one. Per step, with logits z over the vocabulary:

  sample:  z' = z / temperature, keep the top_k largest, keep the smallest set with cumulative prob >= top_p,
           token ~ softmax(z')   (temperature 0 -> argmax)     with a torch.Generator seeded per request
  logprob(token) = log_softmax(z')[token] before the top_k / top_p cut, i.e. of the tempered distribution;
           temperature 0: log_softmax(z)[token]

which is what SGLang's sampler returns by default (it divides the logits by the temperature, takes the softmax and
returns its log). With SGLANG_RETURN_ORIGINAL_LOGPROB=1 in the environment (SGLang's switch, read here too) the
logprob is log_softmax(z)[token] at every temperature. ``top_logprobs_num: n`` adds, per output token, the n most
likely tokens of that same distribution (``meta_info["output_top_logprobs"]``: [[logprob, token_id, None], ...]). The trainer scores tokens under softmax(z / T) with
``--rollout-temperature T`` (default 1), so the recorded logprob is the sampler's probability of the token exactly
when the call sampled at T without top_k / top_p: what the gateway's ``--policy-sampling`` enforces.

Routed experts (MoE models, ``--enable-return-routed-experts``, request ``return_routed_experts: true``; SGLang's
names): a forward hook on every layer's router records the top-k expert ids of each token it processes, by
position; the response's ``meta_info["routed_experts"]`` is base64 of int32 [prompt + output - 1, layers, topk]
(the last token is never fed to the model), -1 in dense layers; a stream carries it in its last chunk only. A
position processed again (its KV cache dropped by a retracting pause, then recomputed, possibly with new weights)
keeps the latest routing, as SGLang's per-slot capture does.

Tensor legend: V = vocabulary, S = sequence (prompt or step tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import inspect
import json
import logging
import os
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from aiohttp import web

from forge_megatron.models import TRANSPOSED_EXPERTS, olmo_hybrid_conv_split
from forge_megatron.rollout.weight_group import broadcast_tensor, init_weight_update_group
from forge_megatron.weight_sync.buckets import missing_partners
from forge_megatron.weight_sync.fp8 import FP8_DTYPE, Fp8Config, dequantize_named
from forge_megatron.weight_sync.int4 import Int4Config, dequantize_named as dequantize_int4_named

log = logging.getLogger("forge.engine")

PAUSE_MODES = ("abort", "in_place", "retract")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
           "float8_e4m3fn": torch.float8_e4m3fn, "int32": torch.int32}  # int32: packed int4 weights


class RequestError(ValueError):
    """A bad request; the message names the field. Answered with HTTP 400."""


@dataclass
class SamplingParams:
    """SGLang ``sampling_params`` (the subset this engine implements; other keys are rejected by name)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    sampling_seed: int | None = None  # per-request sampling seed (None: random)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _require(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 0,
                 f"sampling_params.max_new_tokens must be a non-negative int, got {self.max_new_tokens!r}")
        _require(isinstance(self.temperature, (int, float)) and self.temperature >= 0,
                 f"sampling_params.temperature must be >= 0, got {self.temperature!r}")
        _require(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
                 f"sampling_params.top_p must be in (0, 1], got {self.top_p!r}")
        _require(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
                 f"sampling_params.top_k must be -1 or >= 1, got {self.top_k!r}")
        _require(all(isinstance(s, str) and s for s in self.stop), "sampling_params.stop must be non-empty strings")
        _require(all(isinstance(t, int) for t in self.stop_token_ids), "sampling_params.stop_token_ids must be ints")

    @classmethod
    def from_dict(cls, d: dict | None) -> "SamplingParams":
        d = dict(d or {})
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        _require(not unknown, f"sampling_params has unsupported field(s) {unknown}")
        return cls(**d)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise RequestError(msg)


ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"


def return_original_logprob() -> bool:
    """SGLang's switch: logprobs of the untempered distribution (SGLANG_RETURN_ORIGINAL_LOGPROB=1/true)."""
    return os.environ.get(ORIGINAL_LOGPROB_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def scored_logprobs(logits_V: torch.Tensor, params: SamplingParams, original_logprob: bool = False) -> torch.Tensor:
    """The distribution the engine reports logprobs of (sampled tokens and top alternatives alike): softmax(z / T),
    or softmax(z) when greedy or with ``original_logprob`` (SGLang's two conventions)."""
    if params.temperature == 0 or original_logprob:
        return torch.log_softmax(logits_V, dim=-1)
    return torch.log_softmax(logits_V / params.temperature, dim=-1)


def top_logprobs(logp_V: torch.Tensor, n: int) -> list[list]:
    """SGLang's ``output_top_logprobs`` entry of one position: [[logprob, token_id, None], ...], most likely first
    (text None: SGLang fills it only with ``return_text_in_logprobs``)."""
    values, ids = torch.topk(logp_V, min(n, logp_V.numel()))
    return [[float(v), int(i), None] for v, i in zip(values, ids)]


def sample_next(logits_V: torch.Tensor, params: SamplingParams, gen: torch.Generator,
                original_logprob: bool = False, logp_V: torch.Tensor | None = None) -> tuple[int, float]:
    """Pick the next token from fp32 logits; return (token, its logprob under :func:`scored_logprobs`, which the
    caller may pass as ``logp_V`` when it needs it too)."""
    if logp_V is None:
        logp_V = scored_logprobs(logits_V, params, original_logprob)
    if params.temperature == 0:
        token = int(torch.argmax(logits_V))
        return token, float(logp_V[token])
    z_V = logits_V / params.temperature
    if params.top_k > 0 and params.top_k < z_V.numel():
        kth = torch.topk(z_V, params.top_k).values[-1]
        z_V = z_V.masked_fill(z_V < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_V, order_V = torch.sort(z_V, descending=True)
        cum_V = torch.cumsum(torch.softmax(sorted_V, dim=-1), dim=-1)
        drop_V = cum_V - torch.softmax(sorted_V, dim=-1) >= params.top_p  # mass before this token already >= top_p
        z_V = z_V.scatter(0, order_V, sorted_V.masked_fill(drop_V, float("-inf")))
    token = int(torch.multinomial(torch.softmax(z_V, dim=-1), 1, generator=gen))
    return token, float(logp_V[token])


@dataclass
class _Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    gen: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    past: object = None  # transformers cache; None -> the next step re-encodes everything
    finish: dict | None = None
    aborted: bool = False
    routed: list | None = None  # return_routed_experts: [(first position, int32 [n, layers, topk])] per forward
    top_n: int = 0  # top_logprobs_num
    top: list = field(default_factory=list)  # per output token, its top_n alternatives (see top_logprobs)
    images: list = field(default_factory=list)  # image_data as multimodal.ImageInput, in the order of their tokens
    rope_deltas: object = None  # a vision-language model's mRoPE offset of this request (set by its prefill)
    lora: object = None  # lora_serving.Adapter of its lora_path (None: the base model); kept if unloaded meanwhile
    input_start: int | None = None  # logprob_start_len (with return_logprob): score the input from there
    input_logprobs: list | None = None  # SGLang's input_token_logprobs: [[logprob or None, token_id, None], ...]
    input_top: list | None = None  # SGLang's input_top_logprobs (with top_logprobs_num): per position, as ``top``


class ReferenceEngine:
    """Model, tokenizer and request state; every model touch runs on the single worker thread."""

    def __init__(self, model_path: str, context_length: int | None = None, return_routed_experts: bool = False,
                 lora: dict | None = None, longrope_factors: str | None = None):
        """``lora``: serve LoRA adapters (``--enable-lora``): {max_rank, target_modules} (each may be None).
        ``longrope_factors``: a longrope checkpoint's one factor list ("long" / "short"; None: the trainer's default,
        mcore/rope.py), which every forward rotates with (transformers would switch lists with each forward's
        length, so a cached prompt and its continuation would disagree)."""
        from transformers import AutoTokenizer

        if not os.path.isdir(model_path):
            raise FileNotFoundError(f"--model-path {model_path!r} is not a directory")
        self.model_path = model_path
        self.original_logprob = return_original_logprob()  # SGLANG_RETURN_ORIGINAL_LOGPROB, read at start as SGLang
        # an FP8 checkpoint (quantization_config fp8, block-wise) is dequantized by transformers on CPU: the engine
        # computes with the FP8-rounded weights, and updates must come as FP8 weights + scales, as SGLang loads them.
        # A compressed-tensors int4 one (Kimi-K2-Thinking / K2.5) is dequantized here (transformers 5 cannot put
        # packed experts into its fused expert tensors): same rule, its updates packed int4 + scales + shape
        from forge_megatron.models import causal_lm_from_config, load_causal_lm
        from forge_megatron.weight_sync.int4 import quantization_config_of

        with open(os.path.join(model_path, "config.json")) as f:  # transformers drops it once dequantized
            quantization = quantization_config_of(json.load(f)) or {}
        compressed = quantization.get("quant_method") == "compressed-tensors"
        self.fp8 = None if compressed else Fp8Config.from_hf(quantization)
        self.int4 = Int4Config.from_hf(quantization) if compressed else None
        pinned = _pinned_longrope_config(model_path, longrope_factors)
        extra = {"config": pinned} if pinned is not None else {}
        if self.int4 is None:
            self.model = load_causal_lm(model_path, dtype=torch.float32, **extra).eval()  # Qwen3-VL: its whole model
        else:
            if pinned is not None:
                raise ValueError("a longrope checkpoint compressed to int4 is not supported")
            self.model = causal_lm_from_config(model_path, dtype=torch.float32).eval()
            self.load_from_disk(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        text_config = self.model.config.get_text_config()  # a vision-language model's (Gemma 3) language model's
        self.context_length = context_length or int(getattr(text_config, "max_position_embeddings", 2048))
        self.eos_ids = _eos_ids(text_config, self.tokenizer)
        # transformers >= 5.2x names the KV cache argument `cache`; older versions `past_key_values`
        self.cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forge-engine")
        self.weight_version = "default"
        self.pause_mode: str | None = None
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.running: dict[str, _Request] = {}
        self.admitted: dict[int, _Request] = {}  # every request from its arrival to its end (held by a pause too)
        self.weight_groups: dict[str, object] = {}  # by group name, as SGLang keeps them (one per trainer stage)
        self.routers = self._find_routers() if return_routed_experts else None
        if return_routed_experts and not self.routers:
            raise ValueError(f"--enable-return-routed-experts: {model_path} has no MoE router "
                             "(model.layers.*.mlp.gate or .router)")
        self._captured: dict[int, torch.Tensor] | None = None  # layer -> top-k ids of the forward in progress
        self._images = None  # multimodal.images.ImageProcessor, made on the first request with image_data
        self.lora = None
        if lora is not None:
            from forge_megatron.rollout.lora_serving import LoraServing

            self.lora = LoraServing(self.model, max_rank=lora.get("max_rank"),
                                    target_modules=lora.get("target_modules"),
                                    served_name=lambda module: _in_memory_name(module + ".weight")[: -len(".weight")])

    # --- routed experts -----------------------------------------------------------------------------------------
    def decoder_layers(self):
        """The language model's decoder layers: ``model.layers`` of a causal LM, ``model.language_model.layers`` of
        a vision-language one as transformers 5 holds it (Qwen3-VL-MoE, GLM-4.5V, Kimi-K2.5, MiniMax-M3), or
        ``language_model.model.layers`` (the older layout). Found once: the model object lives as long as the engine
        (weight syncs write into it)."""
        if getattr(self, "_decoder_layers", None) is None:
            self._decoder_layers = self._find_decoder_layers()
        return self._decoder_layers

    def _find_decoder_layers(self):
        for path in ("model.layers", "model.language_model.layers", "language_model.model.layers",
                     "model.language_model.model.layers"):
            node = self.model
            for part in path.split("."):
                node = getattr(node, part, None)
            if node is not None:
                return node
        raise ValueError(f"cannot find the decoder layers of {type(self.model).__name__}")

    def _find_routers(self) -> dict[int, object]:
        """Layer index -> its MoE router (a module returning (logits, weights, top-k ids)), hooked to record."""
        routers = {}
        for i, layer in enumerate(self.decoder_layers()):
            # the MoE block: mlp (most), block_sparse_moe (Granite), feed_forward (LFM2-MoE: its gate takes the
            # selection bias and returns the chosen ids last; Llama 4: its router returns (scores, logits)),
            # Nemotron-H's one mixer; a dense one has no gate / router and is passed over
            mlp = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None) or \
                getattr(layer, "feed_forward", None)
            if mlp is None and getattr(layer, "block_type", None) == "moe":  # (Nemotron-H: a layer's one mixer)
                mlp = layer.mixer
            # gpt-oss names it router; Gemma 4's sits on the layer, its k in its config
            gate = getattr(mlp, "gate", None) or getattr(mlp, "router", None) or getattr(layer, "router", None)
            top_k = getattr(gate, "top_k", None) or getattr(getattr(gate, "config", None), "top_k_experts", None)
            if gate is not None and top_k:
                gate.register_forward_hook(self._record_router(i, int(top_k)))
                routers[i] = gate
                self.router_top_k = int(top_k)
        return routers

    def _record_router(self, layer: int, top_k: int):
        def hook(module, args, output):
            if self._captured is not None:
                ids = output[-1]
                if ids.is_floating_point():  # (Llama 4's router ends with its logits: the experts are their top-k)
                    ids = torch.topk(ids, top_k, dim=-1).indices
                self._captured[layer] = ids.reshape(-1, top_k).to(torch.int32)
        return hook

    def routed_experts(self, req: _Request) -> torch.Tensor:
        """int32 [prompt + output - 1, layers, topk] for ``req``; later forwards of a position overwrite earlier."""
        n = len(req.input_ids) + len(req.output_ids) - 1
        top_k = self.router_top_k
        out = torch.full((n, len(self.decoder_layers()), top_k), -1, dtype=torch.int32)
        for start, ids in req.routed:
            out[start:start + ids.shape[0]] = ids[: max(0, n - start)]
        return out

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)

    # --- generation -------------------------------------------------------------------------------------------
    def new_request(self, body: dict) -> _Request:
        ids = body.get("input_ids")
        _require(isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids),
                 "input_ids must be a non-empty list of ints (text prompts are not supported)")
        vocab = self.model.config.get_text_config().vocab_size
        _require(all(0 <= t < vocab for t in ids), f"input_ids has token ids outside [0, {vocab})")
        params = SamplingParams.from_dict(body.get("sampling_params"))
        _require(len(ids) + params.max_new_tokens <= self.context_length,
                 f"input_ids ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceed the context "
                 f"length ({self.context_length} tokens)")
        want_routing = body.get("return_routed_experts", False)
        _require(isinstance(want_routing, bool), "return_routed_experts must be a boolean")
        _require(not want_routing or self.routers is not None,
                 "return_routed_experts needs the server started with --enable-return-routed-experts")
        top_n = body.get("top_logprobs_num") or 0
        _require(isinstance(top_n, int) and not isinstance(top_n, bool) and 0 <= top_n <= vocab,
                 f"top_logprobs_num must be an int in [0, {vocab}], got {top_n!r}")
        start = body.get("logprob_start_len", -1)
        _require(start is None or (isinstance(start, int) and not isinstance(start, bool) and -1 <= start < len(ids)),
                 f"logprob_start_len must be -1 (none) or an int in [0, {len(ids)}) (the input's positions), got "
                 f"{start!r}")
        seed = params.sampling_seed if params.sampling_seed is not None else int.from_bytes(os.urandom(4), "little")
        gen = torch.Generator().manual_seed(seed)
        images = self._image_inputs(body)
        if images:  # one placeholder per image, written out here as SGLang's processors do
            from forge_megatron.multimodal.families import split_runs

            grids = [im.grid_thw for im in images]
            try:
                ids = self._images.expand_placeholders(list(ids), grids)
                split_runs(ids, grids, self._images.spec)
            except ValueError as exc:
                raise RequestError(f"image_data: {exc}") from None
            _require(len(ids) + params.max_new_tokens <= self.context_length,
                     f"input_ids ({len(ids)} tokens with the images') + max_new_tokens ({params.max_new_tokens}) "
                     f"exceed the context length ({self.context_length} tokens)")
        _require(not (images and start is not None and start >= 0),
                 "logprob_start_len: input logprobs of requests with image_data are not supported here")
        return _Request(rid=str(body.get("rid") or uuid.uuid4().hex), input_ids=list(ids), params=params, gen=gen,
                        routed=[] if want_routing else None, top_n=top_n, images=images,
                        lora=self._adapter(body.get("lora_path")),
                        input_start=start if body.get("return_logprob") and start is not None and start >= 0
                        else None)

    def _adapter(self, name):
        if name is None:
            return None
        _require(self.lora is not None, "lora_path needs the server started with --enable-lora")
        from forge_megatron.rollout.lora_serving import AdapterError

        try:
            return self.lora.get(name)
        except AdapterError as exc:
            raise RequestError(str(exc)) from None

    def _image_inputs(self, body: dict) -> list:
        """SGLang's ``image_data`` (a data URL / base64 string or a list of them, one per image placeholder in
        ``input_ids``; nothing is fetched) as patches of the checkpoint's image processor (multimodal/images.py)."""
        data = body.get("image_data")
        if data is None or data == []:
            return []
        items = [data] if isinstance(data, str) else data
        _require(isinstance(items, list) and all(isinstance(x, str) for x in items),
                 "image_data must be a data URL / base64 string or a list of them")
        from forge_megatron.multimodal.images import ImageError, ImageProcessor, decode_data

        if self._images is None:
            try:
                self._images = ImageProcessor(self.model_path)
            except (ValueError, OSError) as exc:
                raise RequestError(f"image_data: this model takes no images ({exc})") from None
        try:
            images = [self._images.image_input(decode_data(x, f"image_data[{i}]")) for i, x in enumerate(items)]
        except (ImageError, ValueError) as exc:
            raise RequestError(f"image_data: {exc}") from None
        return images

    def _step(self, req: _Request) -> None:
        """One decode step on the worker thread: forward the tokens not yet in the cache, sample one token."""
        all_ids = req.input_ids + req.output_ids
        if req.past is None:
            new_S = torch.tensor([all_ids])
        else:
            new_S = torch.tensor([all_ids[-1:]])
        self._captured = {} if req.routed is not None else None
        extra = {}
        inner = getattr(self.model, "model", None)
        if hasattr(inner, "rope_deltas"):  # a vision-language model keeps the mRoPE offset of the last prefill
            inner.rope_deltas = req.rope_deltas  # on itself: each request's own (steps of requests interleave)
        if req.images and req.past is None:  # the prefill (again after a retracting pause): the images too
            from forge_megatron.multimodal.families import model_image_inputs

            extra = model_image_inputs(self._images.spec, req.images, req.input_ids, new_S)
        if not hasattr(inner, "rope_deltas"):  # 1-D positions: given, as generate() gives them (transformers' Bamba
            # numbers a forward's tokens from 0 when it is given none, whatever its cache holds); mRoPE models
            # derive theirs from rope_deltas
            start = len(all_ids) - new_S.shape[1]
            extra.setdefault("position_ids", torch.arange(start, len(all_ids))[None])
        try:
            with torch.no_grad(), (self.lora.using(req.lora) if self.lora is not None else contextlib.nullcontext()):
                out = self.model(input_ids=new_S, use_cache=True, **{self.cache_kw: req.past}, **extra)
            if hasattr(inner, "rope_deltas"):
                req.rope_deltas = inner.rope_deltas
            if req.routed is not None:
                ids = torch.full((new_S.shape[1], len(self.decoder_layers()), self.router_top_k),
                                 -1, dtype=torch.int32)
                for layer, top in self._captured.items():
                    ids[:, layer] = top
                req.routed.append((len(all_ids) - new_S.shape[1], ids))
        finally:
            self._captured = None
        req.past = out.get("cache", None) or out.get("past_key_values")
        logits_V = out.logits[0, -1].float()
        logp_V = scored_logprobs(logits_V, req.params, self.original_logprob)
        token, logprob = sample_next(logits_V, req.params, req.gen, logp_V=logp_V)
        req.output_ids.append(token)
        req.logprobs.append(logprob)
        if req.top_n:
            req.top.append(top_logprobs(logp_V, req.top_n))
        req.finish = self._finish_reason(req, token)

    def _score_input(self, req: _Request) -> None:
        """``logprob_start_len`` (on the worker thread): each input token's logprob from ``input_start`` on, under the
        distribution the output tokens' are reported in (:func:`scored_logprobs`), as SGLang's
        ``input_token_logprobs``: one [logprob, token_id, None] per position from ``input_start``, the first with
        logprob None (SGLang pads the window's first position; logits at position t score token t + 1)."""
        ids = req.input_ids
        with torch.no_grad(), (self.lora.using(req.lora) if self.lora is not None else contextlib.nullcontext()):
            logits_SV = self.model(input_ids=torch.tensor([ids])).logits[0].float()
        start = req.input_start
        logp_SV = scored_logprobs(logits_SV[start:-1], req.params, self.original_logprob)
        targets = torch.tensor(ids[start + 1:])
        values = logp_SV.gather(-1, targets[:, None])[:, 0].tolist() if len(targets) else []
        req.input_logprobs = [[None, ids[start], None]] + [[v, t, None] for v, t in zip(values, ids[start + 1:])]
        if req.top_n:  # SGLang's input_top_logprobs: the first position None, then each position's top_n
            req.input_top = [None] + [top_logprobs(row, req.top_n) for row in logp_SV]

    def _finish_reason(self, req: _Request, token: int) -> dict | None:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            return {"type": "stop", "matched": token}
        if p.stop:
            text = self.tokenizer.decode(req.output_ids)
            for s in p.stop:
                if s in text:
                    return {"type": "stop", "matched": s}
        if len(req.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": len(req.output_ids)}
        return None

    async def generate(self, req: _Request):
        """Decode ``req`` to the end, yielding after each token (the caller streams or waits)."""
        self.admitted[id(req)] = req
        try:
            await self._wait_resumed(req)
        except BaseException:
            self.admitted.pop(id(req), None)
            raise
        self.running[req.rid] = req
        try:
            if req.input_start is not None:  # prefill-only scoring of the input (a teacher's logprobs)
                await self._wait_resumed(req)
                await self.run(self._score_input, req)
            if req.params.max_new_tokens == 0:
                req.finish = {"type": "length", "length": 0}
            while req.finish is None:
                await self._wait_resumed(req)
                if req.aborted:
                    req.finish = {"type": "abort", "message": "aborted by pause_generation"}
                    break
                await self.run(self._step, req)
                if req.finish is None:
                    yield req
        finally:
            self.running.pop(req.rid, None)
            self.admitted.pop(id(req), None)
        yield req

    async def _wait_resumed(self, req: _Request) -> None:
        while not self.resumed.is_set() and not req.aborted:
            await self.resumed.wait()

    def response(self, req: _Request, return_logprob: bool) -> dict:
        """SGLang's /generate answer; ``routed_experts`` (base64 int32) when the request asked for them."""
        out_ids = req.output_ids
        text = self.tokenizer.decode(out_ids, skip_special_tokens=True)
        matched = (req.finish or {}).get("matched")
        if isinstance(matched, str) and matched in text:
            text = text[: text.index(matched)]
        meta = {
            "id": req.rid,
            "finish_reason": req.finish,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(out_ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.logprobs, out_ids)]
            if req.input_logprobs is not None:
                meta["input_token_logprobs"] = req.input_logprobs
                if req.input_top is not None:
                    meta["input_top_logprobs"] = req.input_top
            if req.top_n:
                meta["output_top_logprobs"] = req.top
        if req.routed is not None and req.finish is not None:  # once, with the last chunk of a stream
            meta["routed_experts"] = base64.b64encode(self.routed_experts(req).numpy().tobytes()).decode("ascii")
        return {"text": text, "output_ids": list(out_ids), "meta_info": meta}

    # --- control ----------------------------------------------------------------------------------------------
    def pause(self, mode: str) -> None:
        _require(mode in PAUSE_MODES, f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        self.pause_mode = mode
        self.resumed.clear()
        if mode == "abort":
            for req in list(self.running.values()):
                req.aborted = True
            self.resumed.set()  # wake the aborted requests; new ones wait on the pause flag below
            self.resumed.clear()

    def resume(self) -> None:
        self.pause_mode = None
        self.resumed.set()

    def flush_cache(self) -> None:
        """Drop the KV caches of requests held by a pause (they are re-encoded on continue).

        Runs on the worker thread while the event loop adds and removes running requests: iterate over a snapshot
        (iterating the live dict raised "dictionary changed size during iteration", a 500 on /pause_generation)."""
        for req in list(self.running.values()):
            req.past = None

    def load_state(self, named: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors into the model; all names and shapes are checked before anything is written.

        Checkpoints and SGLang name MoE experts one by one (``mlp.experts.{e}.{gate,up,down}_proj.weight``);
        transformers >= 5 stores them fused per layer (``mlp.experts.gate_up_proj`` [E, 2I, H] with gate rows
        first, ``mlp.experts.down_proj`` [E, H, I]). Per-expert names are written into the fused slices; Mixtral-
        style names (MiniMax-M2's ``block_sparse_moe.experts.{e}.w1/w3/w2``) too. Qwen3-VL-MoE's checkpoints
        hold the fused tensors transposed ([E, H, 2I], [E, I, H]): they are written through transposed views.

        FP8 (the engine serves an FP8 checkpoint): projection weights must arrive as float8_e4m3fn with their
        ``weight_scale_inv`` in the same request, on the checkpoint's block grid, and are dequantized; an engine
        serving an unquantized checkpoint refuses FP8 weights (SGLang would load them wrongly or fail).
        """
        if self.fp8 is not None:
            plain = [n for n, t in named.items() if self.fp8.quantizes(n, t) and t.dtype != FP8_DTYPE]
            if plain:
                raise RequestError(f"this engine serves an FP8 checkpoint (weight_block_size {list(self.fp8.block)}): "
                                   f"{plain[0]!r} must come as float8_e4m3fn with its weight_scale_inv (trainer "
                                   "--weight-sync-fp8)")
        if self.int4 is not None:
            plain = [n for n, t in named.items() if self.int4.quantizes(n, t)]
            if plain:
                raise RequestError(f"this engine serves an int4 checkpoint (group {self.int4.group}): {plain[0]!r} "
                                   "must come packed, as weight_packed + weight_scale + weight_shape (trainer "
                                   "--weight-sync-int4)")
        try:
            named, _ = dequantize_int4_named(named, self.int4.group if self.int4 else None)
            named, n_fp8 = dequantize_named(named, block=self.fp8.block if self.fp8 else None)
        except ValueError as exc:
            raise RequestError(str(exc)) from exc
        _require(not n_fp8 or self.fp8 is not None,
                 "this engine serves a checkpoint without an fp8 quantization_config: send unquantized weights")
        if self.model.config.model_type == "kimi_k25":  # MoonViT under the release's names: a fused, re-paired wqkv
            from forge_megatron.multimodal.families import kimi_k25_tower_state

            tower = {n: named.pop(n) for n in list(named) if n.startswith(("vision_tower.", "mm_projector."))}
            heads = self.model.config.vision_config.num_attention_heads
            named.update({"model." + n: t for n, t in kimi_k25_tower_state(tower, heads).items()})
        if getattr(self.model.config.get_text_config(), "q_lora_rank", None) is not None:  # Kimi-K2.5's too
            missing = missing_partners(named)
            if missing:
                raise RequestError(f"{missing[0]!r} must come in the same request: SGLang fuses each layer's q_a_proj "
                                   "and kv_a_proj_with_mqa (and a sparse-attention indexer's wk and weights_proj) as "
                                   "both arrive in one load (one without the other is lost)")
        params = self.model.state_dict()
        writes = []  # (destination view, tensor)
        for name, tensor in named.items():
            dest = self._destination(params, name, self.model.config)
            _require(tuple(dest.shape) == tuple(tensor.shape),
                     f"shape of {name!r} is {tuple(tensor.shape)}, the model has {tuple(dest.shape)}")
            writes.append((dest, tensor))
        with torch.no_grad():
            for dest, tensor in writes:
                dest.copy_(tensor.to(dest.dtype))

    @staticmethod
    def _destination(params: dict[str, torch.Tensor], name: str, config) -> torch.Tensor:
        model_type = config.model_type
        if name.endswith(TRANSPOSED_EXPERTS.get(model_type, ())):  # Qwen3-VL-MoE: the checkpoint has transposes
            dest = params.get(name, params.get(_in_memory_name(name)))
            _require(dest is not None, f"unknown parameter name {name!r}")
            return dest.transpose(1, 2)
        if model_type in ("olmo_hybrid", "kimi_linear"):  # released names: the convolution in three, ...
            m = _SPLIT_CONV.fullmatch(name)
            if m is not None:  # q, k or v's rows of transformers' one convolution
                fused = params.get(f"{m.group(1)}.conv1d.weight")
                _require(fused is not None, f"unknown parameter name {name!r}")
                sizes = olmo_hybrid_conv_split(config) if model_type == "olmo_hybrid" else \
                    [config.linear_num_heads * config.linear_head_dim] * 3
                return fused.split(sizes)["qkv".index(m.group(2))]
            m = _OLMO_HYBRID_NORM.fullmatch(name)
            if m is not None and model_type == "olmo_hybrid":  # ... the linear layers' norms
                name = f"{m.group(1)}.{'input' if m.group(2) == 'attention' else 'post_attention'}_layernorm.weight"
            m = _KIMI_FORGET_GATE.fullmatch(name)
            if m is not None and model_type == "kimi_linear":  # ... the forget gate's tensors
                name = f"{m.group(1)}.forget_gate.{m.group(2)}"
        # as named (a vision-language model served whole), as a text-only model holds it, or a release's name in a
        # whole vision-language model
        candidates = (name, _in_memory_name(name), _whole_vl_name(name))
        if model_type == "minimax_m3_vl":
            candidates += (_minimax_m3_name(_in_memory_name(name)),)
        if model_type == "exaone_moe":  # K-EXAONE's score-correction bias: beside the gate on disk, in it in memory
            candidates += (name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),)
        if model_type == "hy_v3":  # Hy3's released names for its router, its bias and its shared expert
            candidates += (name.replace(".mlp.router.gate.weight", ".mlp.gate.weight")
                           .replace(".mlp.expert_bias", ".mlp.e_score_correction_bias")
                           .replace(".mlp.shared_mlp.", ".mlp.shared_experts."),)
        if model_type == "flint":  # Flint's sinks: softmax_offset on disk, sinks in memory
            candidates += (name.replace(".self_attn.softmax_offset", ".self_attn.sinks"),)
        if model_type == "laguna":  # Laguna's shared expert and router bias: their released names, transformers' own
            candidates += (name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
                           .replace(".mlp.experts.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),)
        if model_type == "lfm3":  # LFM3's gate per head: gate_proj on disk, g_proj in memory
            candidates += (name.replace(".self_attn.gate_proj.", ".self_attn.g_proj."),)
        if model_type == "kolibri1":  # Kolibri 1's released names for its router bias and sandwich norms
            candidates += (name.replace(".moe.router.expert_bias", ".mlp.gate.e_score_correction_bias")
                           .replace(".post_attn_norm.", ".post_self_attn_layernorm.")
                           .replace(".post_ffn_norm.", ".post_mlp_layernorm."),)
        if model_type == "axk1":  # A.X K1's norm after the experts: beside the MLP on disk, in it in memory
            candidates += (name.replace(".post_mlp_layernorm.", ".mlp.post_mlp_layernorm."),)
        if model_type == "minicpm5_moe":  # MiniCPM5-MoE's queries and gates: q_proj on disk, q_gate_proj in memory
            candidates += (name.replace(".self_attn.q_proj.", ".self_attn.q_gate_proj."),)
        if model_type == "nemotron_h":  # backbone. on disk, model. in memory; experts one by one on disk, stacked
            name = "model." + name[len("backbone."):] if name.startswith("backbone.") else name
            m = _NEMOTRON_EXPERT.fullmatch(name)
            if m is not None:
                stacked = params.get(f"{m.group(1)}.{m.group(3)}")
                _require(stacked is not None, f"unknown parameter name {name!r}")
                _require(int(m.group(2)) < stacked.shape[0], f"{name!r}: expert {m.group(2)} >= {stacked.shape[0]}")
                return stacked[int(m.group(2))]
            candidates = (name,)
        if model_type == "lfm2_moe":  # LFM2-MoE's experts one by one on disk (w1 / w3 / w2), fused in memory
            m = _LFM2_EXPERT.fullmatch(name)
            if m is not None:
                fused = params.get(f"{m.group(1)}.{'down_proj' if m.group(3) == 'w2' else 'gate_up_proj'}")
                _require(fused is not None, f"unknown parameter name {name!r}")
                e = int(m.group(2))
                _require(e < fused.shape[0], f"{name!r}: expert {e} >= num_experts {fused.shape[0]}")
                if m.group(3) == "w2":
                    return fused[e]
                half = fused.shape[1] // 2
                return fused[e, :half] if m.group(3) == "w1" else fused[e, half:]
        if model_type in ("granitemoe", "granitemoeshared", "granitemoehybrid"):  # Granite's stacked experts on disk
            m = _GRANITE_MOE.fullmatch(name)
            if m is not None:
                candidates += (f"{m.group(1)}.block_sparse_moe.{_GRANITE_IN_MEMORY[m.group(2)]}",)
        for candidate in dict.fromkeys(candidates):
            if candidate in params:
                return params[candidate]
            m = _FUSED_GLU.fullmatch(candidate)
            if m is not None and f"{m.group(1)}.gate_up_proj.weight" in params:  # [gate; up] rows in one tensor
                fused = params[f"{m.group(1)}.gate_up_proj.weight"]
                half = fused.shape[0] // 2
                return fused[:half] if m.group(2) == "gate" else fused[half:]
            m = _PER_EXPERT.fullmatch(candidate)
            if m is not None:
                prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
                fused = params.get(f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}")
                if fused is not None:
                    _require(expert < fused.shape[0], f"{name!r}: expert {expert} >= num_experts {fused.shape[0]}")
                    if proj == "down_proj":
                        return fused[expert]
                    half = fused.shape[1] // 2
                    return fused[expert, :half] if proj == "gate_proj" else fused[expert, half:]
        _require(False, f"unknown parameter name {_in_memory_name(name)!r}")
        raise AssertionError  # unreachable

    def load_from_disk(self, model_path: str) -> None:
        from safetensors.torch import load_file

        _require(os.path.isdir(model_path), f"model_path {model_path!r} is not a directory")
        files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
        _require(bool(files), f"model_path {model_path!r} has no .safetensors files")
        named = {}
        for f in files:
            named.update(load_file(os.path.join(model_path, f)))
        self.load_state(named)

    def receive_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                            group_name: str = "weight_update_group") -> None:
        group = self.weight_groups.get(group_name)
        _require(group is not None, f"no weight update group {group_name!r}: call /init_weights_update_group first "
                                    f"(groups: {sorted(self.weight_groups)})")
        named = {}
        for name, dtype, shape in zip(names, dtypes, shapes):
            buf = torch.empty(shape, dtype=_DTYPES[dtype])
            broadcast_tensor(group, buf, src=0)
            named[name] = buf
        self.load_state(named)


# OLMo Hybrid's and Kimi Linear's released names transformers renames on loading (their linear-attention layers')
_SPLIT_CONV = re.compile(r"(.+\.(?:linear_attn|self_attn))\.([qkv])_conv1d\.weight")
_OLMO_HYBRID_NORM = re.compile(r"(.+)\.(attention|feedforward)_layer_norm\.weight")
_KIMI_FORGET_GATE = re.compile(r"(.+\.self_attn)\.(f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)")
# LFM2-MoE's experts one by one as released (w1 gate, w3 up, w2 down); transformers >= 5 fuses them
_LFM2_EXPERT = re.compile(r"(.+\.feed_forward\.experts)\.(\d+)\.(w1|w3|w2)\.weight")
# Nemotron-H's experts one by one (plain MLPs: up and down) as released; transformers >= 5 stacks them
_NEMOTRON_EXPERT = re.compile(r"(.+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight")
# Granite's MoE tensors as released and as transformers >= 5 holds them
_GRANITE_MOE = re.compile(r"(.+)\.block_sparse_moe\.(input_linear\.weight|output_linear\.weight|router\.layer\.weight)")
_GRANITE_IN_MEMORY = {"input_linear.weight": "experts.gate_up_proj", "output_linear.weight": "experts.down_proj",
                      "router.layer.weight": "router.weight"}
_PER_EXPERT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_MIXTRAL_EXPERT = re.compile(r"(.+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_FUSED_GLU = re.compile(r"(.+\.(?:mlp|shared_experts))\.(gate|up)_proj\.weight")
# MiniMax-M3's released names transformers renames on loading (its tower's, its indexers', its router's bias)
_MINIMAX_M3 = (("model.vision_tower.embeddings.patch_embedding.", "model.vision_tower.embeddings.proj."),
               ("model.vision_tower.encoder.layers.", "model.vision_tower.layers."),
               ("patch_merge_mlp.linear_", "model.multi_modal_projector.merge_linear_"))


def _minimax_m3_name(name: str) -> str:
    """A MiniMax-M3 release's name (after :func:`_in_memory_name`) as transformers' MiniMaxM3SparseForConditional-
    Generation holds it."""
    for theirs, ours in _MINIMAX_M3:
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return name.replace(".self_attn.index_", ".self_attn.indexer.") \
        .replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")


def _in_memory_name(name: str) -> str:
    """A checkpoint name in Mixtral's style (MiniMax-M2: ``block_sparse_moe``, experts' ``w1`` gate, ``w3`` up,
    ``w2`` down; SGLang loads these names) as transformers >= 5 holds it (``mlp``, ``gate_proj`` / ``up_proj`` /
    ``down_proj`` slices of the fused expert tensors); a multimodal checkpoint's language model
    (``model.language_model.``: Qwen3.5) as the text model this engine loads from it holds it (``model.``), and
    Gemma 3's and Kimi-K2.5's (``language_model.model.`` on disk; Kimi-K2.5's head ``language_model.lm_head``) as
    their vision-language models hold them (``model.language_model.``, ``lm_head``), and LLaVA-style towers
    (``vision_tower.*``, Gemma 3's SigLIP released as ``vision_tower.vision_model.*``, ``multi_modal_projector.*``)
    as ``model.vision_tower.*`` / ``model.multi_modal_projector.*``; ERNIE 4.5's ``mlp.moe_statics.*`` as
    ``mlp.gate.moe_statics.*``; MiMo-V2-Flash's ``self_attn.attention_sink_bias`` as ``self_attn.sinks``."""
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model."):]
    elif name.startswith("vision_tower.vision_model."):  # Gemma 3's SigLIP tower as released (SGLang's names)
        name = "model.vision_tower." + name[len("vision_tower.vision_model."):]
    elif name.startswith(("vision_tower.", "multi_modal_projector.")):  # LLaVA-style towers on disk
        name = "model." + name
    elif name.startswith("language_model.model."):
        name = "model.language_model." + name[len("language_model.model."):]
    elif name == "language_model.lm_head.weight":  # Kimi-K2.5's head
        name = "lm_head.weight"
    m = _MIXTRAL_EXPERT.fullmatch(name)
    if m is not None:
        return f"{m.group(1)}.mlp.experts.{m.group(2)}.{_MIXTRAL_PROJ[m.group(3)]}.weight"
    # (ERNIE 4.5's score-correction bias: beside the router on disk, inside it in transformers)
    return name.replace(".block_sparse_moe.", ".mlp.").replace(".mlp.moe_statics.", ".mlp.gate.moe_statics.") \
        .replace(".self_attn.attention_sink_bias", ".self_attn.sinks")


def _whole_vl_name(name: str) -> str:
    """A Qwen2.5-VL / Qwen2-VL release's name (its language model under ``model.``, its tower under ``visual.``; what
    SGLang's loader reads) as transformers >= 5 holds the whole model (``model.language_model.``, ``model.visual.``);
    tried after the name itself, so a text model's ``model.*`` stays its own."""
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model.") and not name.startswith(("model.language_model.", "model.visual.")):
        return "model.language_model." + name[len("model."):]
    return name


def _eos_ids(config, tokenizer) -> set[int]:
    eos = config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


# --- HTTP layer -----------------------------------------------------------------------------------------------
def _ok(message: str = "", **extra) -> web.Response:
    return web.json_response({"success": True, "message": message, **extra})


def _bad(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "BadRequest", "code": status},
                              "success": False, "message": message}, status=status)


async def _json_body(request: web.Request) -> dict:
    try:
        body = await request.json() if request.can_read_body else {}
    except json.JSONDecodeError as exc:
        raise RequestError(f"body is not valid JSON: {exc}") from exc
    _require(isinstance(body, dict), "body must be a JSON object")
    return body


ENGINE = web.AppKey("engine", ReferenceEngine)


def _handler(fn):
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await fn(request, request.app[ENGINE])
        except RequestError as exc:
            return _bad(str(exc))
    return wrapped


@_handler
async def generate(request: web.Request, eng: ReferenceEngine) -> web.StreamResponse:
    body = await _json_body(request)
    req = eng.new_request(body)
    want_lp = bool(body.get("return_logprob", False))
    if not body.get("stream", False):
        async for _ in eng.generate(req):
            pass
        return web.json_response(eng.response(req, want_lp))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    async for _ in eng.generate(req):
        await resp.write(f"data: {json.dumps(eng.response(req, want_lp))}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


@_handler
async def health(request, eng):
    return web.Response(text="")


@_handler
async def model_info(request, eng):
    return web.json_response({"model_path": eng.model_path, "tokenizer_path": eng.model_path,
                              "is_generation": True, "context_length": eng.context_length,
                              "vocab_size": eng.model.config.get_text_config().vocab_size})


@_handler
async def weight_version(request, eng):
    return web.json_response({"weight_version": eng.weight_version})


@_handler
async def flush_cache(request, eng):
    await eng.run(eng.flush_cache)
    return web.Response(text="Cache flushed.\n")


@_handler
async def pause_generation(request, eng):
    body = await _json_body(request)
    eng.pause(body.get("mode", "abort"))
    if eng.pause_mode == "retract":  # on the worker, after any step in flight: KV recomputed on continue
        await eng.run(eng.flush_cache)
    return _ok(f"paused ({eng.pause_mode})")


@_handler
async def continue_generation(request, eng):
    eng.resume()
    return _ok("continued")


def _set_version(eng: ReferenceEngine, body: dict) -> None:
    if body.get("weight_version") is not None:
        eng.weight_version = str(body["weight_version"])


@_handler
async def update_from_disk(request, eng):
    body = await _json_body(request)
    _require(isinstance(body.get("model_path"), str), "model_path is required")
    if body.get("abort_all_requests"):
        eng.pause("abort")
        eng.resume()
    await eng.run(eng.load_from_disk, body["model_path"])
    _set_version(eng, body)
    return _ok("weights updated from disk", num_paused_requests=0)


@_handler
async def init_group(request, eng):
    body = await _json_body(request)
    for key in ("master_address", "master_port", "rank_offset", "world_size"):
        _require(key in body, f"{key} is required")
    name = body.get("group_name", "weight_update_group")
    try:
        eng.weight_groups[name] = await asyncio.to_thread(
            init_weight_update_group, body["master_address"], int(body["master_port"]), int(body["rank_offset"]),
            int(body["world_size"]), name, body.get("backend", "gloo"))
    except (ValueError, RuntimeError) as exc:
        return web.json_response({"success": False, "message": f"init_weights_update_group failed: {exc}"}, 400)
    return _ok("weight update group initialised")


@_handler
async def destroy_group(request, eng):
    """SGLang's ``/destroy_weights_update_group {group_name}``: leave and forget a weight-update group."""
    body = await _json_body(request)
    name = body.get("group_name", "weight_update_group")
    group = eng.weight_groups.pop(name, None)
    _require(group is not None, f"no weight update group {name!r} (groups: {sorted(eng.weight_groups)})")
    try:
        dist.destroy_process_group(group)
    except Exception as exc:  # noqa: BLE001 - forgotten either way
        log.warning("destroying weight update group %s: %s", name, exc)
    return _ok(f"weight update group {name} destroyed")


@_handler
async def update_from_distributed(request, eng):
    body = await _json_body(request)
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    _require(isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list),
             "names, dtypes and shapes must be lists")
    _require(len(names) == len(dtypes) == len(shapes), "names, dtypes and shapes must have the same length")
    _require(all(d in _DTYPES for d in dtypes), f"dtypes must be among {sorted(_DTYPES)}")
    await eng.run(eng.receive_distributed, names, dtypes, shapes, body.get("group_name", "weight_update_group"))
    if body.get("flush_cache", True):
        await eng.run(eng.flush_cache)
    _set_version(eng, body)
    return _ok(f"updated {len(names)} tensors")


def _lora_of(eng: ReferenceEngine):
    _require(eng.lora is not None, "LoRA adapters need the server started with --enable-lora")
    return eng.lora


def _lora_answer(eng: ReferenceEngine, error: str | None = None) -> web.Response:
    """SGLang's LoRAUpdateOutput: success, error_message, loaded_adapters (name -> path); 400 on failure."""
    loaded = {name: a.path for name, a in eng.lora.adapters.items()} if eng.lora is not None else {}
    return web.json_response({"success": error is None, "error_message": error, "loaded_adapters": loaded},
                             status=200 if error is None else 400)


@_handler
async def load_lora_adapter(request, eng):
    from forge_megatron.rollout.lora_serving import AdapterError

    body = await _json_body(request)
    serving = _lora_of(eng)
    _require(isinstance(body.get("lora_path"), str), "lora_path (an adapter directory) is required")
    try:
        await eng.run(serving.load, body.get("lora_name"), body["lora_path"])
    except AdapterError as exc:
        return _lora_answer(eng, str(exc))
    return _lora_answer(eng)


@_handler
async def unload_lora_adapter(request, eng):
    """Forget the adapter at once (new requests naming it are refused), answer once no running request uses it
    (SGLang waits for them the same way)."""
    from forge_megatron.rollout.lora_serving import AdapterError

    body = await _json_body(request)
    serving = _lora_of(eng)
    adapter = serving.adapters.get(body.get("lora_name"))
    try:
        await eng.run(serving.unload, body.get("lora_name"))
    except AdapterError as exc:
        return _lora_answer(eng, str(exc))
    while any(r.lora is adapter for r in list(eng.admitted.values())):
        await asyncio.sleep(0.01)
    return _lora_answer(eng)


_CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed",
                "n", "stream", "user"}


def chat_request(eng: ReferenceEngine, body: dict) -> _Request:
    """OpenAI's chat completion request (the subset a judge or a tool uses: text messages, max_tokens, temperature,
    top_p, stop, seed; n = 1, no streaming) as a /generate request: the checkpoint's chat template rendered with
    the assistant's turn opened, as SGLang's /v1/chat/completions does."""
    unknown = sorted(set(body) - _CHAT_FIELDS)
    _require(not unknown,
             f"/v1/chat/completions: unsupported field(s) {unknown} (this engine takes {sorted(_CHAT_FIELDS)})")
    messages = body.get("messages")
    _require(isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages),
        "messages must be a non-empty list of {role, content} with text content")
    _require(body.get("n", 1) == 1, "n must be 1")
    _require(not body.get("stream", False), "stream is not supported on /v1/chat/completions here (use /generate)")
    stop = body.get("stop")
    params = {"max_new_tokens": body.get("max_completion_tokens", body.get("max_tokens", 256)),
              "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
              "stop": [stop] if isinstance(stop, str) else (stop or [])}
    if body.get("seed") is not None:
        params["sampling_seed"] = body["seed"]
    try:
        ids = eng.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # noqa: BLE001 - a template that rejects these messages is the caller's error
        raise RequestError(f"messages: the chat template cannot render them ({exc})") from None
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # (transformers 5: a BatchEncoding)
    return eng.new_request({"input_ids": ids, "sampling_params": params})


@_handler
async def chat_completions(request, eng):
    """OpenAI's /v1/chat/completions over the engine (SGLang serves it too): a judge model for LLM-graded rewards
    (agents/judge.py) runs on it; text in, text out, no tools."""
    body = await _json_body(request)
    req = chat_request(eng, body)
    async for _ in eng.generate(req):
        pass
    answer = eng.response(req, False)
    finish = (req.finish or {}).get("type", "stop")
    if finish == "abort":
        return _bad(f"the request was aborted ({req.finish.get('message')}): send it again", 503)
    return web.json_response({
        "id": f"chatcmpl-{req.rid}", "object": "chat.completion", "created": int(time.time()),
        "model": body.get("model") or eng.model_path,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": answer["text"]},
                     "finish_reason": "length" if finish == "length" else "stop"}],
        "usage": {"prompt_tokens": len(req.input_ids), "completion_tokens": len(req.output_ids),
                  "total_tokens": len(req.input_ids) + len(req.output_ids)},
    })


@_handler
async def models(request, eng):
    """OpenAI's model list as SGLang answers it: the base model, then every loaded adapter (``parent``: the base)."""
    served = eng.model_path
    cards = [{"id": served, "object": "model", "root": served, "max_model_len": eng.context_length}]
    if eng.lora is not None:
        cards += [{"id": name, "object": "model", "root": a.path, "parent": served, "max_model_len": None}
                  for name, a in eng.lora.adapters.items()]
    return web.json_response({"object": "list", "data": cards})


def make_app(engine: ReferenceEngine, max_body_bytes: int = 64 << 20) -> web.Application:
    """The aiohttp application serving ``engine`` with SGLang's routes (a reward model's: reward_model.py)."""
    from forge_megatron.rollout.reward_model import RewardEngine, make_reward_app

    if isinstance(engine, RewardEngine):
        return make_reward_app(engine, max_body_bytes)
    app = web.Application(client_max_size=max_body_bytes)
    app[ENGINE] = engine
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/get_weight_version", weight_version)
    app.router.add_route("*", "/flush_cache", flush_cache)
    app.router.add_post("/pause_generation", pause_generation)
    app.router.add_post("/continue_generation", continue_generation)
    app.router.add_post("/update_weights_from_disk", update_from_disk)
    app.router.add_post("/init_weights_update_group", init_group)
    app.router.add_post("/destroy_weights_update_group", destroy_group)
    app.router.add_post("/update_weights_from_distributed", update_from_distributed)
    app.router.add_post("/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/unload_lora_adapter", unload_lora_adapter)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="forge-engine",
        description="CPU reference engine with SGLang's HTTP API (generate, pause/continue, weight updates; a "
                    "sequence-classification checkpoint, i.e. a reward model, is served on /classify as SGLang's "
                    "--is-embedding does). Example: forge-engine --model-path /tmp/tiny --port 30000",
    )
    p.add_argument("--model-path", required=True, help="local HF model directory (config.json, *.safetensors, tokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=30000, help="TCP port (0 picks a free one; the chosen port is printed)")
    p.add_argument("--context-length", type=int, default=None, help="max prompt + new tokens (default: model config)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--longrope-factors", choices=["long", "short"], default=None,
                   help="longrope checkpoints (Phi-3.5, Phi-4-mini): rotate every forward with this factor list "
                        "(default: long when the context exceeds the original one; the trainer's "
                        "--longrope-factors must agree)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="MoE models: record every token's top-k experts per layer, returned to requests that set "
                        "return_routed_experts (SGLang's flag; used for rollout routing replay)")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters beside the base weights (SGLang's flag): /load_lora_adapter, "
                        "/unload_lora_adapter, /generate's lora_path (trainer --weight-sync-lora adapter)")
    p.add_argument("--max-lora-rank", type=int, default=None,
                   help="with --enable-lora: refuse adapters of a higher rank, as SGLang does (default: any)")
    p.add_argument("--is-embedding", action="store_true",
                   help="SGLang's flag for a reward model: accepted for parity (a sequence-classification checkpoint "
                        "is served on /classify anyway); refused for a generating checkpoint")
    p.add_argument("--lora-target-modules", nargs="+", default=None, metavar="MODULE",
                   help="with --enable-lora: the HF module names adapters may adapt (q_proj k_proj ...; 'all' or "
                        "unset: any linear), refused otherwise as SGLang does")
    return p


def _pinned_longrope_config(model_path: str, factors: str | None):
    """The checkpoint's transformers config with its longrope factor lists both the chosen one (``factors``; None:
    long when its context exceeds the original one, as the trainer chooses), or None for another RoPE (``factors``
    given then: ValueError)."""
    from transformers import AutoConfig

    from forge_megatron.mcore import rope

    config = AutoConfig.from_pretrained(model_path)
    text = config.get_text_config()
    params = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
    if rope.rope_type(params) != "longrope":
        if factors is not None:
            raise ValueError(f"--longrope-factors: {model_path} has no longrope RoPE")
        return None
    original = params.get("original_max_position_embeddings") or getattr(text, "original_max_position_embeddings")
    checked = rope.check({**params, "original_max_position_embeddings": original, "longrope_factors": factors},
                         int(text.max_position_embeddings))
    pinned = rope.pinned_longrope(params, checked["longrope_factors"])
    if getattr(text, "rope_parameters", None) is not None:
        text.rope_parameters = pinned
    else:
        text.rope_scaling = pinned
    log.info("longrope: every forward rotates with the %s factors", checked["longrope_factors"])
    return config


def engine_from_args(args: argparse.Namespace):
    """The engine forge-engine's flags describe: a ReferenceEngine, or for a sequence-classification checkpoint (a
    reward model) a ``reward_model.RewardEngine`` serving SGLang's /classify."""
    from forge_megatron.rollout.reward_model import RewardEngine, is_reward_model

    if (args.max_lora_rank is not None or args.lora_target_modules) and not args.enable_lora:
        raise ValueError("--max-lora-rank / --lora-target-modules need --enable-lora")
    reward_model = is_reward_model(args.model_path)
    if getattr(args, "is_embedding", False) and not reward_model:
        raise ValueError(f"--is-embedding: {args.model_path} is not a sequence-classification checkpoint (a reward "
                         "model); this engine serves generating models without it")
    if reward_model:
        if args.enable_lora or args.enable_return_routed_experts:
            raise ValueError(f"{args.model_path} is a reward model (sequence classification): --enable-lora and "
                             "--enable-return-routed-experts are for generating models")
        return RewardEngine(args.model_path, context_length=args.context_length)
    lora = {"max_rank": args.max_lora_rank, "target_modules": args.lora_target_modules} if args.enable_lora else None
    return ReferenceEngine(args.model_path, context_length=args.context_length,
                           return_routed_experts=args.enable_return_routed_experts, lora=lora,
                           longrope_factors=getattr(args, "longrope_factors", None))


async def serve(engine: ReferenceEngine, host: str, port: int, ready=None) -> None:
    """Serve until cancelled; ``ready(port)`` is called once listening."""
    from forge_megatron.rollout.launch import serve_app

    await serve_app(make_app(engine), host, port, ready)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s forge-engine %(message)s")
    t0 = time.time()
    try:
        engine = engine_from_args(args)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"forge-engine: {exc}") from exc
    log.info("loaded %s in %.1fs", args.model_path, time.time() - t0)
    from forge_megatron.rollout.launch import print_ready, until_terminated

    asyncio.run(until_terminated(serve(engine, args.host, args.port, ready=print_ready)))  # SIGTERM: exit 0


if __name__ == "__main__":
    main()
