"""forge-engine serving a reward model: SGLang's ``/classify`` for a sequence-classification checkpoint.

SGLang serves a reward model (``--is-embedding``; ``LlamaForSequenceClassification``,
``Qwen2ForSequenceClassification``, ... e.g. Skywork-Reward) on ``POST /classify`` with an ``EmbeddingReqInput``
body: ``text`` (a string or a list) or ``input_ids`` (a list of ids or a list of lists), tokenized as given (``text``
with the tokenizer's special tokens, as SGLang's tokenizer manager adds them). The answer is one ``{"embedding":
[score per label], "meta_info": {...}}`` per input (a single object for a single input, a list for a batch): the
classifier head's logits at the sequence's last token. forge-engine does the same on CPU with transformers' ``AutoModelForSequenceClassification`` (the reference
implementation), so the rollout side's reward-model verifier (agents/reward_model.py) runs against a real model in
tests and on machines without SGLang. ``/generate`` and chat completions are refused by name: this engine does not
generate. The reward model is never trained here, so it takes no weight updates.

A checkpoint is served this way when its ``architectures[0]`` ends in ``ForSequenceClassification``
(:func:`is_reward_model`).
"""

from __future__ import annotations

import asyncio
import json
import os
from concurrent.futures import ThreadPoolExecutor

import torch
from aiohttp import web

from forge_megatron.rollout.engine_server import _bad, _json_body

MAX_BATCH = 256  # inputs per /classify request


def is_reward_model(model_path: str) -> bool:
    """True when ``model_path``'s config.json names a sequence-classification architecture."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            archs = json.load(f).get("architectures") or []
    except (OSError, json.JSONDecodeError):
        return False
    return bool(archs) and str(archs[0]).endswith("ForSequenceClassification")


class RewardEngine:
    """A sequence-classification model and its tokenizer; scores run one at a time on a worker thread."""

    def __init__(self, model_path: str, context_length: int | None = None):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not os.path.isdir(model_path):
            raise FileNotFoundError(f"--model-path {model_path!r} is not a directory")
        self.model_path = model_path
        self.model = AutoModelForSequenceClassification.from_pretrained(model_path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.context_length = context_length or int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.vocab_size = int(self.model.config.vocab_size)
        self.num_labels = int(self.model.config.num_labels)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forge-rm")
        self._next_id = 0

    def inputs_of(self, body: dict) -> tuple[list[list[int]], bool]:
        """(token ids per input, single) of an ``EmbeddingReqInput`` body; ValueError naming the bad field."""
        unknown = sorted(set(body) - {"text", "input_ids", "rid", "priority", "log_metrics", "sampling_params"})
        if unknown:
            raise ValueError(f"/classify: unsupported field(s) {unknown} (this engine takes text or input_ids)")
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise ValueError("/classify needs exactly one of text and input_ids")
        if text is not None:
            single = isinstance(text, str)
            texts = [text] if single else text
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise ValueError("text must be a string or a list of strings")
            batch = [self.tokenizer.encode(t) for t in texts]
        else:
            single = isinstance(ids, list) and bool(ids) and all(isinstance(x, int) for x in ids)
            batch = [ids] if single else ids
            if not isinstance(batch, list) or not all(
                    isinstance(seq, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in seq)
                    for seq in batch):
                raise ValueError("input_ids must be a list of token ids or a list of such lists")
        if not batch or len(batch) > MAX_BATCH:
            raise ValueError(f"/classify takes 1 to {MAX_BATCH} inputs, got {len(batch)}")
        for i, seq in enumerate(batch):
            if not seq:
                raise ValueError(f"input {i} is empty")
            if len(seq) > self.context_length:
                raise ValueError(f"input {i} has {len(seq)} tokens, over the context length {self.context_length}")
            bad = [x for x in seq if not 0 <= x < self.vocab_size]
            if bad:
                raise ValueError(f"input {i}: token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        return batch, single

    def score(self, batch: list[list[int]]) -> list[list[float]]:
        """The classifier's logits at each input's last token, as SGLang's last-token pooler reads them (transformers'
        own pooling takes the last token that is not the pad token, which differs when an input ends in it); each
        input runs alone, so no padding to get wrong."""
        out = []
        head = getattr(self.model, "score", None)
        with torch.no_grad():
            for seq in batch:
                ids = torch.tensor([seq])
                if head is not None:
                    hidden = self.model.base_model(input_ids=ids).last_hidden_state
                    logits = head(hidden[0, -1])
                else:
                    logits = self.model(input_ids=ids).logits[0]
                out.append([float(x) for x in logits])
        return out

    async def classify(self, body: dict) -> list[dict] | dict:
        batch, single = self.inputs_of(body)
        scores = await asyncio.get_running_loop().run_in_executor(self._worker, self.score, batch)
        answers = []
        for seq, embedding in zip(batch, scores):
            self._next_id += 1
            answers.append({"embedding": embedding,
                            "meta_info": {"id": str(body.get("rid") or f"classify-{self._next_id}"),
                                          "prompt_tokens": len(seq)}})
        return answers[0] if single else answers


RM_ENGINE = web.AppKey("reward_engine", RewardEngine)


async def _classify(request: web.Request) -> web.Response:
    try:  # (RequestError, the engine's bad-request error, is a ValueError)
        return web.json_response(await request.app[RM_ENGINE].classify(await _json_body(request)))
    except ValueError as exc:
        return _bad(str(exc))


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="")


async def _model_info(request: web.Request) -> web.Response:
    eng = request.app[RM_ENGINE]
    return web.json_response({"model_path": eng.model_path, "tokenizer_path": eng.model_path, "is_generation": False,
                              "context_length": eng.context_length, "vocab_size": eng.vocab_size,
                              "num_labels": eng.num_labels})


async def _not_generating(request: web.Request) -> web.Response:
    eng = request.app[RM_ENGINE]
    return _bad(f"{request.path}: {eng.model_path} is a reward model (sequence classification): it scores on "
                  "/classify and does not generate")


def make_reward_app(engine: RewardEngine, max_body_bytes: int = 64 << 20) -> web.Application:
    app = web.Application(client_max_size=max_body_bytes)
    app[RM_ENGINE] = engine
    app.router.add_post("/classify", _classify)
    app.router.add_get("/health", _health)
    app.router.add_get("/health_generate", _health)
    app.router.add_get("/get_model_info", _model_info)
    for path in ("/generate", "/v1/chat/completions", "/v1/completions"):
        app.router.add_post(path, _not_generating)
    return app
