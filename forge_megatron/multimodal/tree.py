"""Prefix trees of samples with images: merge only what is really shared, keep what the vision side needs per token.

Two samples can have the same token ids and different images (every image token of a Qwen-VL model has the same id),
so the tree is built on *keys*: a text token is its id, the k-th token of an image is a key made of the image's
content and k (``VIRTUAL_BASE + image_number * stride + k``, image numbers given per distinct image content). Samples
merge exactly where their tokens and their images agree; each tree token's id is then restored, and the image tokens
remember which row of the micro-batch's vision features they take.

:class:`VisionTree` rides on the :class:`~forge_megatron.tree.TreeLayout` (its ``vision``): the distinct images'
pixel values and grids (each encoded once per micro-batch however many samples share it), per tree token its feature
row (-1 for text) and its three mRoPE positions (multimodal/families.py). mcore/vision.py hands them to the model.

Legend: T = tree tokens, P = sample tokens, U = distinct images, N = image tokens of the distinct images.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from forge_megatron.multimodal.families import VisionSpec, image_token_spans, positions_3d

VIRTUAL_BASE = 1 << 40  # above any vocabulary: image-token keys live here


@dataclass(frozen=True)
class ImageInput:
    """One image as the vision tower takes it: its patches ``pixel_values`` float [patches, channels * patch volume]
    (the HF image processor's output for this image) and its grid ``(t, h, w)`` of patches."""

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]

    def __post_init__(self):
        pv = np.asarray(self.pixel_values)
        if pv.ndim != 2:
            raise ValueError(f"pixel_values must be 2-D [patches, features], got shape {pv.shape}")
        grid = tuple(int(x) for x in self.grid_thw)
        if len(grid) != 3 or min(grid) < 1 or pv.shape[0] != grid[0] * grid[1] * grid[2]:
            raise ValueError(f"grid_thw {self.grid_thw} does not match {pv.shape[0]} patches")
        object.__setattr__(self, "pixel_values", pv)
        object.__setattr__(self, "grid_thw", grid)

    @functools.cached_property
    def digest(self) -> str:
        """What makes two images the same: their grid and their pixel values' bytes (hashed once)."""
        h = hashlib.sha256(np.asarray(self.grid_thw, dtype=np.int64).tobytes())
        h.update(str(self.pixel_values.dtype).encode())
        h.update(np.ascontiguousarray(self.pixel_values).tobytes())
        return h.hexdigest()


@dataclass
class VisionTree:
    """The vision side of one tree-packed micro-batch.

    Attributes:
        pixel_values: float [patches of the U distinct images, features], images in order.
        grid_thw: int64 [U, 3].
        rows_T: int64 [T], the row of each tree token in the images' features [N, H] (-1: a text token).
        positions_T3: int64 [T, 3], the tree tokens' mRoPE positions.
        spec: the model's :class:`VisionSpec`.
        features: filled by mcore/vision.py, once per micro-batch and tower (keyed by the tower's name: the policy's
            and the KL reference's differ when the tower trains): (merged features [N, H], DeepStack [N, H] list),
            computed without gradients.
        live: mcore/vision.py's features of the forward in progress of a trained tower (by the tower's name).
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    rows_T: torch.Tensor
    positions_T3: torch.Tensor
    spec: VisionSpec
    features: dict = field(default_factory=dict, repr=False)
    live: dict = field(default_factory=dict, repr=False)

    @property
    def num_images(self) -> int:
        return int(self.grid_thw.shape[0])

    def padded(self, length: int) -> "VisionTree":
        """For ``TreeLayout.padded``: padding tokens are text at position 0."""
        extra = length - self.rows_T.numel()
        if extra <= 0:
            return self
        return VisionTree(self.pixel_values, self.grid_thw, torch.cat([self.rows_T, self.rows_T.new_full((extra,), -1)]),
                          torch.cat([self.positions_T3, self.positions_T3.new_zeros(extra, 3)]), self.spec,
                          self.features, self.live)


def sample_keys(samples_tokens: list, samples_images: list, spec: VisionSpec,
                samples_sampled: list | None = None) -> tuple[list, dict, int]:
    """The tree keys of every sample (int64 arrays), the distinct images ({digest: (number, ImageInput)}, numbered
    in first-appearance order) and the keys' stride (one image's key range). ``samples_sampled``: the samples' loss
    masks (an image token the policy sampled is text: families.image_runs)."""
    distinct: dict[str, tuple[int, ImageInput]] = {}
    keys = []
    stride = 1 + max((spec.tokens_per_image(im.grid_thw) for ims in samples_images for im in ims or ()), default=0)
    sampled = samples_sampled or [None] * len(samples_tokens)
    for s, (tokens, images) in enumerate(zip(samples_tokens, samples_images)):
        tokens = np.asarray(tokens, dtype=np.int64)
        images = list(images or ())
        try:
            spans = image_token_spans(tokens, [im.grid_thw for im in images], spec, sampled[s])
        except ValueError as e:
            raise ValueError(f"sample {s}: {e}") from None
        key = tokens.copy()
        for rows, image in zip(spans, images):
            number, _ = distinct.setdefault(image.digest, (len(distinct), image))
            done = 0  # (the tokens of an image's rows: its features in order; the breaks between stay text)
            for start, end in rows:
                key[start:end] = VIRTUAL_BASE + number * stride + done + np.arange(end - start)
                done += end - start
        keys.append(key)
    return keys, distinct, stride


def build_vision_tree(samples_tokens: list, samples_images: list, spec: VisionSpec, backend: str = "auto",
                      samples_sampled: list | None = None):
    """The :class:`~forge_megatron.tree.TreeLayout` of samples with images (``samples_images[s]``: sample s's
    :class:`ImageInput` list in the order of its image-token runs; empty for a text sample), its ``vision`` set.
    ``samples_sampled``: the samples' loss masks (image tokens the policy sampled are text)."""
    from forge_megatron.tree import build_tree

    if len(samples_tokens) != len(samples_images):
        raise ValueError(f"{len(samples_tokens)} samples but {len(samples_images)} image lists")
    keys, distinct, stride = sample_keys(samples_tokens, samples_images, spec, samples_sampled)
    layout = build_tree(keys, backend=backend)
    key_T = layout.tokens
    is_image_T = key_T >= VIRTUAL_BASE
    images = [im for _, im in sorted(distinct.values(), key=lambda v: v[0])]
    counts = torch.tensor([spec.tokens_per_image(im.grid_thw) for im in images], dtype=torch.int64)
    first_row = torch.cumsum(counts, 0) - counts  # each image's first row in the features
    rows_T = torch.full_like(key_T, -1)
    local = key_T[is_image_T] - VIRTUAL_BASE
    rows_T[is_image_T] = first_row[local // stride] + local % stride
    sampled = samples_sampled or [None] * len(samples_tokens)
    positions_P3 = np.concatenate([positions_3d(t, [im.grid_thw for im in ims or ()], spec, m)
                                   for t, ims, m in zip(samples_tokens, samples_images, sampled)])
    positions_T3 = torch.zeros(layout.unique_tokens, 3, dtype=torch.int64)
    positions_T3[layout.sample_nodes] = torch.from_numpy(positions_P3)
    if not torch.equal(positions_T3[layout.sample_nodes], torch.from_numpy(positions_P3)):
        raise AssertionError("a shared prefix has different mRoPE positions in two samples")  # cannot happen
    if images:
        pixel_values = torch.from_numpy(np.concatenate([im.pixel_values for im in images]))
        grid_thw = torch.tensor([im.grid_thw for im in images], dtype=torch.int64)
    else:
        pixel_values, grid_thw = torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.int64)
    vision = VisionTree(pixel_values, grid_thw, rows_T, positions_T3, spec)
    tokens_T = torch.where(is_image_T, torch.full_like(key_T, spec.image_token_id), key_T)
    return layout.with_tokens(tokens_T, vision)
