"""The vision-language families' language-model inputs: image tokens, their positions (Qwen's 3-D mRoPE), the towers.

Qwen3-VL, Qwen3.5 and GLM-4.xV first (the rules below), then what Gemma 3 / 4, Mistral 3 and Kimi-K2.5 do otherwise.

A vision-language sample is a token sequence in which every image is a run of ``image_token_id`` tokens (one per
merged patch: ``t * h * w / merge^2`` for an image of grid ``(t, h, w)`` patches) between the text tokens its chat
template writes around it (``<|vision_start|>`` / ``<|vision_end|>``). The language model sees:

- the vision tower's merged patch features in place of the image tokens' embeddings (and, on Qwen3-VL, DeepStack:
  the features of some of the tower's blocks added to the hidden states after the first language-model layers, at
  the image tokens);
- multimodal RoPE: each token has three positions (time, height, width). A text token sits at ``p`` on all three
  axes (so text alone is plain RoPE); an image starting at position ``p`` puts its token (i, j) at
  ``(p, p + i, p + j)``, and the text after it goes on from ``p + max(h, w) / merge``. The rotary angle of frequency
  ``k`` takes one axis's position: with ``mrope_interleaved`` (Qwen3-VL, Qwen3.5) frequency k uses axis 1 when
  ``k % 3 == 1 and k < 3 * section[1]``, axis 2 when ``k % 3 == 2 and k < 3 * section[2]``, else axis 0; without it
  (Qwen2-VL's layout) the first ``section[0]`` frequencies use axis 0, the next ``section[1]`` axis 1, then axis 2.

Gemma 3 (4B-27B, ``Gemma3ForConditionalGeneration``) is handled here too, with three differences: its images are all
``image_size`` squares (a SigLIP tower's ``(image_size / patch_size)^2`` patches average-pooled to
``mm_tokens_per_image`` tokens: grid ``(1, p, p)`` with ``merge`` the pooling kernel), its positions are plain 1-D
(an image token is one position, as a text token: ``mrope_section`` None), and the tokens of one image see each
other (``bidirectional``: transformers' ``token_type_ids`` mask, tree attention's ``key_end``). Its tower is the
checkpoint's ``vision_tower`` and ``multi_modal_projector`` (:class:`Gemma3Tower`), which takes the images' patches
as the Qwen towers do (``ImageInput.pixel_values``: [patches, 3 * patch^2], row-major, channels first within a
patch) and puts each image back together for SigLIP's convolution.

Gemma 4 (``Gemma4ForConditionalGeneration``, its images; E2B / E4B's per-layer inputs take an image token as the pad
token with its image features, mcore/gemma4.py) is Gemma 3's with images of any size: the processor
resizes each (aspect kept) to a patch budget with sides that are multiples of ``patch_size * pooling_kernel_size``,
its patches (row-major, channels last within a patch) go through the vision tower with their (x, y) positions,
``pooling_kernel_size``^2 patches average-pooled into each token (grid ``(1, h, w)`` patches, ``merge`` the kernel),
and ``embed_vision`` projects them (:class:`Gemma4Tower`). An image's tokens see each other in the sliding-window
layers only (``bidirectional == "sliding"``; the releases whose text config says
``use_bidirectional_attention: "vision"``), the global layers staying causal, as transformers' Gemma 4 masks them.

Mistral 3 (``Mistral3ForConditionalGeneration`` with a dense language model: Ministral 3, Mistral Small 3.x) writes an
image row by row: each row of ``w / merge`` image tokens is followed by ``[IMG_BREAK]``, the last by ``[IMG_END]``
(``row_breaks``: an image is ``h / merge`` runs of image tokens, :func:`image_token_spans`). Its Pixtral tower takes
the image whole (patches put back together, as Gemma 3's), with 2-D RoPE over its patches, and the projector merges
``merge x merge`` patches into each token (:class:`Mistral3Tower`); positions are 1-D and attention causal. Mistral
Small 4 (multi-latent attention and experts in the same checkpoint class) takes its images alike.

Kimi-K2.5 / K2.6 (``kimi_k25``) merges ``k x k`` row-major patches of its MoonViT tower (2-D RoPE, a learned position
grid resampled to each image) into one run of tokens, projected by ``mm_projector`` (:class:`KimiK25Tower`); 1-D
positions, causal attention. Its release names the tower otherwise than transformers (a fused ``wqkv`` whose query
and key rows pair channels (2i, 2i + 1)): :func:`kimi_k25_tower_state` and :func:`kimi_k25_released_state` convert.

These are the rules of transformers' ``Qwen3VLModel.get_rope_index`` and ``Qwen3VLTextRotaryEmbedding`` (transformers
5.24), which the tests compare with; a token's positions depend only on the tokens before it, so a prefix shared by
several samples has the same positions in each, and the prefix tree (multimodal/tree.py) holds them per tree token.

Legend: L = tokens of one sample, T = tokens, I = images, D = rotary dim, N = image tokens, H = hidden size.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass

import numpy as np
import torch

# vision-language checkpoints whose image inputs this module handles, by their HF ``model_type``: Qwen3-VL / -MoE,
# Qwen3.5 (dense and MoE), Qwen2.5-VL / Qwen2-VL and GLM-4.1V / 4.6V-Flash / 4.5V / 4.6V (the same positions;
# Qwen2.x-VL's and GLM's mRoPE sections are contiguous, GLM's each frequency's angle repeated for its interleaved pair
# of channels), then Gemma 3 / 4, Mistral 3 and Kimi-K2.5 (below)
_VL_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "qwen2_5_vl", "qwen2_vl", "glm4v", "glm4v_moe",
             "glm46v", "gemma3", "gemma4", "mistral3", "kimi_k25")
# model types whose releases (and transformers' save_pretrained) hold the tower under ``visual.`` (Qwen2.5-VL, Qwen2-VL)
_RELEASE_VISUAL = ("qwen2_5_vl", "qwen2_vl")
SUPPORTED = ("Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen2.5-VL, Qwen2-VL, GLM-4.xV, Gemma 3, Gemma 4, Mistral 3 "
             "(Ministral 3, Mistral Small 3.x and 4) and Kimi-K2.5 / K2.6")


@dataclass(frozen=True)
class VisionSpec:
    """What the language model needs to know of a checkpoint's images (read off its HF config by :func:`vision_spec`)."""

    image_token_id: int
    merge: int  # spatial_merge_size: merge x merge patches make one image token (Gemma 3 and 4: the pooling kernel)
    mrope_section: tuple[int, int, int] | None  # rotary frequencies per axis (time, height, width), summing to D / 2;
    # None: 1-D positions (Gemma 3 and 4, Mistral 3, Kimi-K2.5), the model's own RoPE
    interleaved: bool  # mrope_interleaved (Qwen3-VL, Qwen3.5) or contiguous sections (Qwen2-VL's and GLM-4.xV's)
    deepstack_layers: int  # language-model layers (the first ones) that get DeepStack features added
    vision_prefix: str = "model.visual."  # the tower's tensors in the checkpoint (Gemma 3, Mistral 3: "" and Gemma 4,
    # Kimi-K2.5: "model.", before the names of their tower modules; Kimi's release: kimi_k25_tower_state)
    bidirectional: bool | str = False  # the tokens of an image see each other (Gemma 3: True, in every layer;
    # Gemma 4: "sliding", in the sliding-window layers only)
    image_size: int = 0  # Gemma 3: every image is an image_size square of (image_size / patch_size)^2 patches
    patch_size: int = 0
    kind: str = "qwen"  # "qwen" (Qwen-VL, GLM-4.xV), "gemma3", "gemma4", "mistral3" or "kimi_k25": which tower and
    # image inputs
    row_breaks: bool = False  # each row of an image's tokens is a run of its own, a break token after it (Mistral 3)
    feature_layer: int = -1  # Mistral 3: the tower's hidden states that the projector takes (vision_feature_layer)

    @property
    def gemma3(self) -> bool:
        return self.kind == "gemma3"

    @property
    def gemma4(self) -> bool:
        return self.kind == "gemma4"

    @property
    def mistral3(self) -> bool:
        return self.kind == "mistral3"

    @property
    def kimi(self) -> bool:
        return self.kind == "kimi_k25"

    def rows_of_image(self, grid_thw) -> tuple[int, int]:
        """(runs, tokens per run) of an image's tokens: its rows with row breaks, else one run of all."""
        t, h, w = (int(x) for x in grid_thw)
        if self.row_breaks:
            return t * h // self.merge, w // self.merge
        return 1, self.tokens_per_image(grid_thw)

    def tokens_per_image(self, grid_thw) -> int:
        t, h, w = (int(x) for x in grid_thw)
        if h % self.merge or w % self.merge:
            raise ValueError(f"image grid {tuple(grid_thw)} is not a multiple of the merge size {self.merge}")
        return t * h * w // (self.merge * self.merge)


def vision_spec(hf_config: dict) -> VisionSpec:
    """The :class:`VisionSpec` of a vision-language checkpoint's config (dict); ValueError naming the model when its
    images are not supported (:data:`SUPPORTED`)."""
    text = hf_config.get("text_config") or {}
    vision = hf_config.get("vision_config") or {}
    kind = hf_config.get("model_type")
    arch = (hf_config.get("architectures") or ["?"])[0]
    image_token = next((hf_config[k] for k in ("image_token_id", "image_token_index", "media_placeholder_token_id")
                        if hf_config.get(k) is not None), None)
    if kind not in _VL_TYPES or not vision or image_token is None:
        raise ValueError(f"{arch}: training on images is supported for {SUPPORTED} vision-language checkpoints only "
                         "(text-only RL works for the others)")
    if kind == "gemma3":
        size, patch = int(vision.get("image_size", 224)), int(vision.get("patch_size", 14))
        side, tokens = size // patch, int(hf_config.get("mm_tokens_per_image", 256))
        per_side = math.isqrt(tokens)
        if size % patch or per_side * per_side != tokens or side % per_side:
            raise ValueError(f"{arch}: images of {size} pixels in patches of {patch} cannot pool to {tokens} tokens")
        return VisionSpec(image_token_id=int(image_token), merge=side // per_side, mrope_section=None,
                          interleaved=False, deepstack_layers=0, vision_prefix="", bidirectional=True,
                          image_size=size, patch_size=patch, kind="gemma3")
    if kind == "gemma4":
        # the 31B / 26B-A4B releases: an image's tokens see each other in the sliding layers ("vision"); the smaller
        # ones attend causally
        both_ways = "sliding" if text.get("use_bidirectional_attention") == "vision" else False
        return VisionSpec(image_token_id=int(image_token), merge=int(vision.get("pooling_kernel_size", 3)),
                          mrope_section=None, interleaved=False, deepstack_layers=0, vision_prefix="model.",
                          bidirectional=both_ways, patch_size=int(vision.get("patch_size", 16)), kind="gemma4")
    if kind == "mistral3":
        layer = hf_config.get("vision_feature_layer", -1)
        if not isinstance(layer, int):
            raise ValueError(f"{arch}: vision_feature_layer {layer!r} (several layers joined) is not supported")
        return VisionSpec(image_token_id=int(image_token), merge=int(hf_config.get("spatial_merge_size", 2)),
                          mrope_section=None, interleaved=False, deepstack_layers=0, vision_prefix="",
                          patch_size=int(vision.get("patch_size", 14)), kind="mistral3", row_breaks=True,
                          feature_layer=layer)
    if kind == "kimi_k25":  # MoonViT: patches of patch_size merged k x k (row-major) into a token, 1-D positions
        kernel = vision.get("merge_kernel_size", (2, 2))
        kernel = (kernel, kernel) if isinstance(kernel, int) else tuple(kernel)
        if kernel[0] != kernel[1]:
            raise ValueError(f"{arch}: merge_kernel_size {kernel} is not square")
        return VisionSpec(image_token_id=int(image_token), merge=int(kernel[0]), mrope_section=None,
                          interleaved=False, deepstack_layers=0, vision_prefix="model.",
                          patch_size=int(vision.get("patch_size", 14)), kind="kimi_k25")
    text = text or hf_config  # (Qwen2.5-VL / Qwen2-VL as released: a flat config)
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    if not section or len(section) != 3:
        raise ValueError(f"{arch}: its text_config has no 3-part mrope_section ({rope!r})")
    indexes = vision.get("deepstack_visual_indexes") or ()
    return VisionSpec(image_token_id=int(hf_config["image_token_id"]), merge=int(vision.get("spatial_merge_size", 2)),
                      mrope_section=tuple(int(s) for s in section),
                      interleaved=bool(rope.get("mrope_interleaved", False)), deepstack_layers=len(indexes),
                      vision_prefix="visual." if kind in _RELEASE_VISUAL else "model.visual.")


def image_runs(tokens_L: np.ndarray, image_token_id: int, sampled_L=None) -> list[tuple[int, int]]:
    """(start, end) of every maximal run of image tokens in one sample; with ``sampled_L`` (the loss mask: 1 where
    the policy sampled the token) only among the prompt's tokens: an image token the model sampled is text."""
    is_image = np.asarray(tokens_L) == image_token_id
    if sampled_L is not None:
        is_image &= np.asarray(sampled_L) == 0
    is_image = np.concatenate([[False], is_image, [False]])
    edges = np.flatnonzero(is_image[1:] != is_image[:-1])
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def image_token_spans(tokens_L: np.ndarray, grids: list, spec: VisionSpec, sampled_L=None) -> list[list]:
    """Per image of one sample, the (start, end) of each run of its tokens: one run, or with ``spec.row_breaks`` one
    per row (each exactly a row's tokens, the runs of one image consecutive); ValueError when the image tokens do not
    match ``grids``. ``sampled_L``: see :func:`image_runs`."""
    if not spec.row_breaks:
        return [[span] for span in split_runs(tokens_L, grids, spec, sampled_L)]
    runs = image_runs(tokens_L, spec.image_token_id, sampled_L)
    out, k = [], 0
    for i, grid in enumerate(grids):
        rows, cols = spec.rows_of_image(grid)
        mine = runs[k:k + rows]
        if len(mine) < rows or any(b - a != cols for a, b in mine):
            raise ValueError(f"image {i} ({rows} rows of {cols} tokens) does not match the sample's image tokens "
                             f"{[(a, b) for a, b in mine]}")
        out.append(mine)
        k += rows
    if k != len(runs):
        raise ValueError(f"image tokens at {runs[k][0]}..{runs[-1][1]} beyond the sample's {len(grids)} image(s)")
    return out


def split_runs(tokens_L: np.ndarray, grids: list, spec: VisionSpec, sampled_L=None) -> list[tuple[int, int]]:
    """(start, end) of each image's tokens in one sample, in order; ValueError when the image tokens do not add up to
    ``grids`` (adjacent images form one run and are split by their token counts; with ``spec.row_breaks`` from the
    first token of an image's first row to the last of its last). ``sampled_L``: see :func:`image_runs`."""
    if spec.row_breaks:
        return [(rows[0][0], rows[-1][1]) for rows in image_token_spans(tokens_L, grids, spec, sampled_L)]
    counts = [spec.tokens_per_image(g) for g in grids]
    spans, k = [], 0
    for start, end in image_runs(tokens_L, spec.image_token_id, sampled_L):
        while start < end:
            if k == len(counts):
                raise ValueError(f"image tokens at {start}..{end} beyond the sample's {len(counts)} image(s)")
            if start + counts[k] > end:
                raise ValueError(f"image tokens at {start}..{end} do not match the sample's images (image {k} has "
                                 f"{counts[k]} tokens)")
            spans.append((start, start + counts[k]))
            start += counts[k]
            k += 1
    if k != len(counts):
        raise ValueError(f"the sample has {len(counts)} image(s) but image tokens for {k}")
    return spans


def positions_3d(tokens_L, grids: list, spec: VisionSpec, sampled_L=None) -> np.ndarray:
    """int64 [L, 3] (time, height, width) mRoPE positions of one sample with images of ``grids`` (t, h, w patches)
    (``sampled_L``: see :func:`image_runs`); for a model without mRoPE (Gemma 3 / 4, Mistral 3, Kimi-K2.5) each
    token's 1-D position thrice."""
    tokens_L = np.asarray(tokens_L)
    if spec.mrope_section is None:
        split_runs(tokens_L, grids, spec, sampled_L)  # (the same checks)
        return np.repeat(np.arange(tokens_L.size, dtype=np.int64)[:, None], 3, axis=1)
    out = np.empty((tokens_L.size, 3), dtype=np.int64)
    pos, cursor = 0, 0
    for (start, end), grid in zip(split_runs(tokens_L, grids, spec, sampled_L), grids):
        n = start - cursor  # the text before the image
        out[cursor:start] = (pos + np.arange(n))[:, None]
        pos += n
        t, h, w = int(grid[0]), int(grid[1]) // spec.merge, int(grid[2]) // spec.merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        out[start:end] = pos + np.stack([tt.ravel(), hh.ravel(), ww.ravel()], axis=1)
        pos += max(h, w)
        cursor = end
    out[cursor:] = (pos + np.arange(tokens_L.size - cursor))[:, None]
    return out


def axis_of_frequency(half_dim: int, spec: VisionSpec) -> torch.Tensor:
    """int64 [D / 2]: which position axis each rotary frequency takes."""
    if sum(spec.mrope_section) != half_dim:
        raise ValueError(f"mrope_section {spec.mrope_section} does not add up to the {half_dim} rotary frequencies")
    axis = torch.zeros(half_dim, dtype=torch.int64)
    if spec.interleaved:
        for a in (1, 2):
            axis[a:3 * spec.mrope_section[a]:3] = a
    else:
        axis[spec.mrope_section[0]:spec.mrope_section[0] + spec.mrope_section[1]] = 1
        axis[spec.mrope_section[0] + spec.mrope_section[1]:] = 2
    return axis


def mrope_angles(rotary, positions_T3: torch.Tensor, spec: VisionSpec) -> torch.Tensor:
    """The rotary table [T, 1, 1, D] Megatron's attention takes, for tokens at 3-D ``positions_T3``: what
    ``RotaryEmbedding.get_emb`` makes for 1-D positions, each frequency taking its own axis's position."""
    inv_freq = rotary.inv_freq
    axis = axis_of_frequency(inv_freq.numel(), spec).to(inv_freq.device)
    pos = positions_T3.to(device=inv_freq.device, dtype=inv_freq.dtype)
    if getattr(rotary, "seq_len_interpolation_factor", None) is not None:
        pos = pos / rotary.seq_len_interpolation_factor
    freqs = pos.gather(1, axis[None].expand(pos.shape[0], -1)) * inv_freq  # [T, D / 2]
    if getattr(rotary, "rotary_interleaved", False):
        emb = torch.stack((freqs, freqs), dim=-1).reshape(freqs.shape[0], -1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


# ------------------------------------------------------------------------------------------------ vision tower
def _full_config(hf_config):
    """The transformers config of a checkpoint (``hf_config``: its directory or its config dict)."""
    import transformers

    if isinstance(hf_config, str):
        return transformers.AutoConfig.from_pretrained(hf_config, local_files_only=True)
    return transformers.AutoConfig.for_model(**hf_config)


def _vision_config(hf_config):
    """The transformers config of a checkpoint's vision tower (``hf_config``: its directory or its config dict)."""
    return _full_config(hf_config).vision_config


def _new_tower(config):
    """A fresh tower module of a checkpoint's transformers ``config``: ``AutoModel`` of its ``vision_config``, or for
    Gemma 3 the SigLIP tower with its projector (:class:`Gemma3Tower`), for Gemma 4 its tower and ``embed_vision``
    (:class:`Gemma4Tower`), for Mistral 3 Pixtral and its projector (:class:`Mistral3Tower`), for Kimi-K2.5 MoonViT
    and its projector (:class:`KimiK25Tower`)."""
    if config.model_type == "gemma3":
        return Gemma3Tower(config)
    if config.model_type == "gemma4":
        return Gemma4Tower(config)
    if config.model_type == "mistral3":
        return Mistral3Tower(config)
    if config.model_type == "kimi_k25":
        return KimiK25Tower(config)
    return vision_model(config.vision_config)


def vision_model(vision_config):
    """The transformers module of a Qwen-style tower's ``vision_config``: ``AutoModel``'s, or Qwen2-VL's class (its
    tower has no AutoModel entry)."""
    import transformers

    if vision_config.model_type == "qwen2_vl_vision":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        return Qwen2VisionTransformerPretrainedModel._from_config(vision_config)
    return transformers.AutoModel.from_config(vision_config)


class KimiK25Tower(torch.nn.Module):
    """Kimi-K2.5's image side as one module: the MoonViT ``vision_tower`` (2-D RoPE over each image's patches, a
    learned position grid resampled to its size) and the ``mm_projector`` (a norm, the merged ``k x k`` patches
    concatenated, two linear layers), named as transformers holds them (under ``model.``; the release's names are
    converted on reading: :func:`kimi_k25_tower_state`). Takes the images' patches ([patches, 3 * patch^2],
    :func:`image_patches`' layout: row-major, as the tower's merge reads them) and grids, gives ``pooler_output``
    [tokens, H] in image order, as transformers' ``Kimi_K25Model.get_image_features`` does."""

    def __init__(self, config):
        from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25MultimodalProjection, Kimi_K25VisionModel

        super().__init__()
        self.vision_tower = Kimi_K25VisionModel._from_config(config.vision_config)
        self.mm_projector = Kimi_K25MultimodalProjection(config)
        self.patch_size = int(config.vision_config.patch_size)

    def gradient_checkpointing_enable(self, **kwargs):
        self.vision_tower.gradient_checkpointing_enable(**kwargs)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, return_dict: bool = True):
        from types import SimpleNamespace

        p = self.patch_size
        pooled = self.vision_tower(pixel_values.reshape(-1, 3, p, p), grid_thw=grid_thw,
                                   return_dict=True).pooler_output
        return SimpleNamespace(pooler_output=self.mm_projector(pooled).squeeze(1))


# Kimi-K2.5's tower as released (MoonViT's own names: a fused wqkv whose query / key rows pair channels (2i, 2i + 1)
# for its complex RoPE) -> transformers' (q / k / v, rows pairing (i, i + d / 2)), in the order transformers'
# conversion mapping applies them.
_KIMI_RENAMES = ((r"\.norm0\.", ".norm1."), (r"\.norm1\.", ".norm2."), (r"\.mlp\.fc0\.", ".mlp.fc1."),
                 (r"\.mlp\.fc1\.", ".mlp.fc2."), (r"\.wo\.", ".attn.proj."))


def kimi_k25_rope_rows(t: torch.Tensor, heads: int, inverse: bool = False) -> torch.Tensor:
    """A query / key projection's rows (weight or bias) from the release's pairing of channels (2i, 2i + 1) within
    each head to transformers' (i, i + d / 2) (``inverse``: back)."""
    half = t.shape[0] // heads // 2
    x = t.reshape(heads, *((2, half) if inverse else (half, 2)), *t.shape[1:])
    return x.transpose(1, 2).reshape(t.shape)


def kimi_k25_tower_state(released: dict, heads: int) -> dict:
    """transformers' names (those of :class:`KimiK25Tower`) of a released Kimi-K2.5 tower's tensors (names without
    ``vision_tower.`` / ``mm_projector.`` stripped): the blocks' renames, ``wqkv`` split into q / k / v with the query
    and key rows re-paired (:func:`kimi_k25_rope_rows`), the projector's ``proj.0`` / ``proj.2`` and the position grid
    under their modules' names."""
    out = {}
    for name, t in released.items():
        new = name
        if name.startswith("vision_tower.encoder.blocks."):
            block = name[len("vision_tower.encoder.blocks."):]
            index, _, rest = block.partition(".")
            rest = "." + rest
            for pattern, repl in _KIMI_RENAMES:  # (simultaneous: norm0 -> norm1 and norm1 -> norm2 both)
                if re.match(pattern, rest):
                    rest = re.sub(pattern, repl, rest, count=1)
                    break
            if rest.startswith(".wqkv."):
                for part, chunk in zip(("q_proj", "k_proj", "v_proj"), t.chunk(3)):
                    out[f"vision_tower.layers.{index}.attn.{part}.{rest[len('.wqkv.'):]}"] = \
                        chunk if part == "v_proj" else kimi_k25_rope_rows(chunk, heads)
                continue
            new = f"vision_tower.layers.{index}{rest}"
        elif name.startswith("vision_tower.encoder."):
            new = "vision_tower." + name[len("vision_tower.encoder."):]
        elif name == "vision_tower.patch_embed.pos_emb.weight":
            new = "vision_tower.patch_embed.pos_emb.position_embeddings"
        elif name.startswith("mm_projector.proj.0."):
            new = "mm_projector.in_proj." + name[len("mm_projector.proj.0."):]
        elif name.startswith("mm_projector.proj.2."):
            new = "mm_projector.out_proj." + name[len("mm_projector.proj.2."):]
        out[new] = t
    return out


def kimi_k25_released_state(state: dict, heads: int) -> dict:
    """The release's names of :class:`KimiK25Tower`'s tensors (the inverse of :func:`kimi_k25_tower_state`)."""
    out = {}
    qkv: dict = {}
    back = {".norm1.": ".norm0.", ".norm2.": ".norm1.", ".mlp.fc1.": ".mlp.fc0.", ".mlp.fc2.": ".mlp.fc1.",
            ".attn.proj.": ".wo."}
    for name, t in state.items():
        if name.startswith("vision_tower.layers."):
            index, _, rest = name[len("vision_tower.layers."):].partition(".")
            rest = "." + rest
            m = re.match(r"\.attn\.(q_proj|k_proj|v_proj)\.(\w+)$", rest)
            if m:
                qkv.setdefault((index, m.group(2)), {})[m.group(1)] = \
                    t if m.group(1) == "v_proj" else kimi_k25_rope_rows(t, heads, inverse=True)
                continue
            for a, b in back.items():
                if rest.startswith(a):
                    rest = b + rest[len(a):]
                    break
            out[f"vision_tower.encoder.blocks.{index}{rest}"] = t
        elif name == "vision_tower.patch_embed.pos_emb.position_embeddings":
            out["vision_tower.patch_embed.pos_emb.weight"] = t
        elif name.startswith("vision_tower.patch_embed."):
            out[name] = t
        elif name.startswith("vision_tower."):
            out["vision_tower.encoder." + name[len("vision_tower."):]] = t
        elif name.startswith("mm_projector.in_proj."):
            out["mm_projector.proj.0." + name[len("mm_projector.in_proj."):]] = t
        elif name.startswith("mm_projector.out_proj."):
            out["mm_projector.proj.2." + name[len("mm_projector.out_proj."):]] = t
        else:
            out[name] = t
    for (index, attr), parts in qkv.items():
        out[f"vision_tower.encoder.blocks.{index}.wqkv.{attr}"] = torch.cat(
            [parts["q_proj"], parts["k_proj"], parts["v_proj"]])
    return out


class Mistral3Tower(torch.nn.Module):
    """Mistral 3's image side as one module: the Pixtral ``vision_tower`` and the ``multi_modal_projector`` (a norm,
    the merge of ``spatial_merge_size``^2 patches, two linear layers), named as in the checkpoint. Takes the images'
    patches ([patches, 3 * patch^2], :func:`image_patches`' layout) and grids, puts each image back together and gives
    ``pooler_output`` [tokens, H] in image order (rows of ``w / merge``), as transformers'
    ``Mistral3Model.get_image_features`` does (its ``vision_feature_layer``'s hidden states)."""

    def __init__(self, config):
        import transformers
        from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector

        super().__init__()
        self.vision_tower = transformers.AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = Mistral3MultiModalProjector(config)
        self.patch_size, self.feature_layer = config.vision_config.patch_size, config.vision_feature_layer

    def gradient_checkpointing_enable(self, **kwargs):
        self.vision_tower.gradient_checkpointing_enable(**kwargs)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, return_dict: bool = True):
        from types import SimpleNamespace

        out, start = [], 0
        for t, h, w in grid_thw.tolist():
            n = t * h * w
            image = patches_image(pixel_values[start:start + n], h, w, self.patch_size)[None]
            start += n
            sizes = [(h * self.patch_size, w * self.patch_size)]
            hidden = self.vision_tower(image, image_sizes=sizes, output_hidden_states=True,
                                       return_dict=True).hidden_states[self.feature_layer]
            out.append(self.multi_modal_projector(hidden.squeeze(0), sizes))
        return SimpleNamespace(pooler_output=torch.cat(out) if out else pixel_values.new_zeros(0))


class Gemma4Tower(torch.nn.Module):
    """Gemma 4's image side as one module: the ``vision_tower`` and ``embed_vision`` (a scale-free norm and a
    projection into the language model), named as in the checkpoint (under ``model.``). Takes the images' patches
    ([patches, patch^2 * 3] in the processor's layout, row-major) and grids, runs the images of one size together
    (without the processor's padding: the same features) with their (x, y) patch positions, and gives
    ``pooler_output`` [tokens, H] in image order, as transformers' ``Gemma4Model.get_image_features`` does."""

    def __init__(self, config):
        import transformers
        from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder

        super().__init__()
        self.vision_tower = transformers.AutoModel.from_config(config.vision_config)
        self.embed_vision = Gemma4MultimodalEmbedder(config.vision_config, config.text_config)

    def gradient_checkpointing_enable(self, **kwargs):
        self.vision_tower.gradient_checkpointing_enable(**kwargs)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, return_dict: bool = True):
        from types import SimpleNamespace

        grids = [tuple(int(x) for x in g) for g in grid_thw.tolist()]
        starts = [0, *itertools.accumulate(t * h * w for t, h, w in grids)]
        out: list = [None] * len(grids)
        for grid in dict.fromkeys(grids):  # the images of one size in one call
            which = [i for i, g in enumerate(grids) if g == grid]
            batch = torch.stack([pixel_values[starts[i]:starts[i + 1]] for i in which])
            _, h, w = grid
            ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            positions = torch.stack([xs.reshape(-1), ys.reshape(-1)], -1).to(batch.device)
            hidden = self.vision_tower(pixel_values=batch, pixel_position_ids=positions.expand(len(which), -1, -1),
                                       return_dict=True).last_hidden_state
            # (the tower gives the images' valid tokens flattened: [images * tokens, hidden])
            features = self.embed_vision(inputs_embeds=hidden).reshape(len(which), -1,
                                                                       self.embed_vision.text_hidden_size)
            for j, i in enumerate(which):
                out[i] = features[j]
        return SimpleNamespace(pooler_output=torch.cat(out) if out else pixel_values.new_zeros(0))


class Gemma3Tower(torch.nn.Module):
    """Gemma 3's image side as one module: the SigLIP tower and the ``multi_modal_projector`` (average pooling to
    ``mm_tokens_per_image``, a norm, a projection), named as the released checkpoints and SGLang name them
    (``vision_tower.vision_model.*``: transformers 5 saves ``vision_tower.*`` and reads both; HFReader does too).
    Takes the images' patches ([patches, 3 * patch^2], :func:`image_patches`) and gives ``pooler_output``
    [images * tokens per image, H], as transformers' ``Gemma3Model.get_image_features`` does for the same images."""

    def __init__(self, config):
        import transformers
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        super().__init__()
        self.vision_tower = torch.nn.Module()
        self.vision_tower.vision_model = transformers.AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)
        self.image_size, self.patch_size = config.vision_config.image_size, config.vision_config.patch_size

    def gradient_checkpointing_enable(self, **kwargs):
        self.vision_tower.vision_model.gradient_checkpointing_enable(**kwargs)

    def forward(self, pixel_values: torch.Tensor, grid_thw=None, return_dict: bool = True):
        from types import SimpleNamespace

        images = gemma3_images(pixel_values, self.image_size, self.patch_size)
        hidden = self.vision_tower.vision_model(pixel_values=images, return_dict=True).last_hidden_state
        features = self.multi_modal_projector(hidden)
        return SimpleNamespace(pooler_output=features.reshape(-1, features.shape[-1]))


def gemma4_inputs(images: list) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Gemma 4 image inputs of ``images`` (ImageInputs): patches padded to the largest image
    [images, patches, features] and their (x, y) positions [images, patches, 2], -1 on the padding."""
    most = max(im.pixel_values.shape[0] for im in images)
    pixels = torch.zeros(len(images), most, images[0].pixel_values.shape[1])
    positions = torch.full((len(images), most, 2), -1, dtype=torch.long)
    for i, im in enumerate(images):
        _, h, w = im.grid_thw
        pixels[i, :h * w] = torch.from_numpy(np.asarray(im.pixel_values))
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        positions[i, :h * w] = torch.stack([xs.reshape(-1), ys.reshape(-1)], -1)
    return pixels, positions


def model_image_inputs(spec: VisionSpec, images: list, prompt_ids: list[int], ids_1S: torch.Tensor) -> dict:
    """The image keyword arguments of a transformers vision-language model's prefill of ``ids_1S`` [1, S] (the prompt
    ``prompt_ids`` and any tokens sampled after it) with ``images`` (ImageInputs): Qwen-VL / GLM-4.xV's patches and
    grids, Gemma 3's whole images, Gemma 4's padded patches and positions, Mistral 3's padded images and sizes,
    Kimi-K2.5's patches [N, 3, p, p] and grids; the
    image-token types mark the prompt's image tokens (an image token the model sampled is text)."""
    prompt_images = torch.zeros_like(ids_1S)
    prompt_images[:, :len(prompt_ids)] = torch.tensor([prompt_ids]) == spec.image_token_id
    if spec.mistral3:
        pixel_values, sizes = mistral3_inputs(images, spec.patch_size)
        return dict(pixel_values=pixel_values, image_sizes=sizes)
    if spec.gemma4:
        pixel_values, positions = gemma4_inputs(images)
        return dict(pixel_values=pixel_values, image_position_ids=positions, mm_token_type_ids=prompt_images)
    pixels = torch.from_numpy(np.concatenate([im.pixel_values for im in images]))
    if spec.gemma3:
        return dict(pixel_values=gemma3_images(pixels, spec.image_size, spec.patch_size), token_type_ids=prompt_images)
    if spec.kimi:  # (patches as [N, 3, p, p]; its tokens need no types)
        return dict(pixel_values=pixels.reshape(-1, 3, spec.patch_size, spec.patch_size),
                    image_grid_thw=torch.tensor([im.grid_thw for im in images]))
    return dict(pixel_values=pixels, image_grid_thw=torch.tensor([im.grid_thw for im in images]),
                mm_token_type_ids=(ids_1S == spec.image_token_id).int())


def mistral3_inputs(images: list, patch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Mistral 3 image inputs of ``images`` (ImageInputs): the images put back together and padded to
    the largest [images, 3, H, W], and their sizes [images, 2]."""
    whole = [patches_image(torch.from_numpy(np.asarray(im.pixel_values)), im.grid_thw[1], im.grid_thw[2], patch)
             for im in images]
    height, width = max(x.shape[1] for x in whole), max(x.shape[2] for x in whole)
    padded = whole[0].new_zeros(len(whole), 3, height, width)
    for i, x in enumerate(whole):
        padded[i, :, :x.shape[1], :x.shape[2]] = x
    return padded, torch.tensor([list(x.shape[1:]) for x in whole])


def image_patches(images_N3HW: torch.Tensor, patch: int) -> torch.Tensor:
    """Images [N, 3, H, W] as patches [N * (H / patch) * (W / patch), 3 * patch^2]: row-major over each image's patch
    grid, channels first within a patch (as :class:`~forge_megatron.multimodal.tree.ImageInput` holds Gemma 3's and
    Mistral 3's)."""
    n, c, height, width = images_N3HW.shape
    h, w = height // patch, width // patch
    x = images_N3HW.reshape(n, c, h, patch, w, patch).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(n * h * w, c * patch * patch)


def patches_image(patches: torch.Tensor, h: int, w: int, patch: int) -> torch.Tensor:
    """The image [3, h * patch, w * patch] of one image's :func:`image_patches` (an h x w grid)."""
    if patches.dim() != 2 or patches.shape[0] != h * w or patches.shape[1] % (patch * patch):
        raise ValueError(f"{tuple(patches.shape)} is not the patches of an image of {h} x {w} patches of {patch}")
    c = patches.shape[1] // (patch * patch)
    return patches.reshape(h, w, c, patch, patch).permute(2, 0, 3, 1, 4).reshape(c, h * patch, w * patch)


def gemma3_images(patches: torch.Tensor, size: int, patch: int) -> torch.Tensor:
    """The images [N, 3, size, size] of :func:`image_patches`' patches."""
    side = size // patch
    if patches.dim() != 2 or patches.shape[0] % (side * side) or patches.shape[1] % (patch * patch):
        raise ValueError(f"{tuple(patches.shape)} is not the patches of {size}-pixel images in patches of {patch}")
    c = patches.shape[1] // (patch * patch)
    x = patches.reshape(-1, side, side, c, patch, patch).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(-1, c, size, size)


def build_vision_tower(hf_config, dtype: torch.dtype | None = None, device=None):
    """The checkpoint's vision tower (``AutoModel`` of its ``vision_config``, a transformers module; Gemma 3's, Gemma
    4's and Mistral 3's: :class:`Gemma3Tower`, :class:`Gemma4Tower`, :class:`Mistral3Tower`), freshly initialised: the
    trainer's trainable tower, whose weights come through the bridge (``Bridge(vision_tower=True)``) like the language
    model's."""
    return _new_tower(_full_config(hf_config)).to(device=device, dtype=dtype)


def meta_vision_tower(hf_config):
    """The checkpoint's vision tower on the meta device (its names and shapes: no memory, no weights)."""
    config = _full_config(hf_config)
    with torch.device("meta"):
        return _new_tower(config)


def tower_tensor_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    """{name in the tower's state dict: shape}."""
    return {name: tuple(t.shape) for name, t in meta_vision_tower(hf_config).state_dict().items()}


def load_vision_tower(hf_dir: str, spec: VisionSpec | None = None, dtype: torch.dtype | None = None, device=None):
    """The checkpoint's vision tower as a frozen transformers module (``AutoModel`` of its ``vision_config``) with the
    checkpoint's weights; in eval mode, no gradients. Read from local files only."""
    import transformers

    from forge_megatron.convert.checkpoint import HFReader

    config = transformers.AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    prefix = (spec or vision_spec(config.to_dict())).vision_prefix
    tower = _new_tower(config)
    reader = HFReader(hf_dir)
    # (Gemma 3 and 4: the tower module's own names, under the prefix)
    own = isinstance(tower, (Gemma3Tower, Gemma4Tower, Mistral3Tower, KimiK25Tower))
    names = [prefix + n for n in tower.state_dict()] if own else [n for n in reader.names() if n.startswith(prefix)]
    if isinstance(tower, KimiK25Tower) and not set(names) & set(reader.names()):  # as released: MoonViT's names
        released = [n for n in reader.names() if n.startswith(("vision_tower.", "mm_projector."))]
        state = kimi_k25_tower_state(reader.get(released), int(config.vision_config.num_attention_heads))
    else:
        state = {n[len(prefix):]: t for n, t in reader.get(names).items()}
    if not state:
        raise ValueError(f"{hf_dir!r} has no {prefix or 'vision_tower.'}* tensors: not a vision-language "
                         "checkpoint's vision tower")
    missing, unexpected = tower.load_state_dict(state, strict=False)
    missing = [m for m in missing if m not in dict(tower.named_buffers())]  # non-persistent buffers
    if missing or unexpected:
        raise ValueError(f"{hf_dir!r}: the vision tower does not fit its config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    tower = tower.to(device=device, dtype=dtype).eval()
    tower.requires_grad_(False)
    return tower


def encode_images(tower, pixel_values: torch.Tensor, grid_thw: torch.Tensor,
                  grad: bool = False) -> tuple[torch.Tensor, list]:
    """Merged patch features [N, H] of the images (concatenated in order) and the DeepStack features (a list of
    [N, H], one per DeepStack layer; empty for towers without). Without gradients unless ``grad`` (a trained tower's
    forward)."""
    param = next(tower.parameters())
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        out = tower(pixel_values.to(device=param.device, dtype=param.dtype), grid_thw=grid_thw.to(param.device),
                    return_dict=True)
    return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])
