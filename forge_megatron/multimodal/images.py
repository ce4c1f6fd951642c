"""Images as the gateway, the engine and the trainer see them: one normalized file per image, one processor.

An agent's image (a data URL or base64 in the OpenAI / Anthropic / Responses request) is decoded, checked and
*normalized* by the gateway: converted to RGB and resized (bicubic) to the size the checkpoint's image processor
would give it, a multiple of ``patch_size * merge_size`` within its pixel bounds, then written as a PNG. That PNG is
what the engine is sent (``image_data``), what the trajectory records and what the trainer encodes, so all three
agree on the image's token count (a second resize by an engine, SGLang's to multiples of 28 included, lands on the
same grid) and the engine and the trainer compute the same patches from the same bytes with the same processor
(the checkpoint's ``preprocessor_config.json``, transformers' ``AutoImageProcessor``).

Gemma 3's images are all one size: the target is the checkpoint's ``image_size`` square (resized with its
processor's filter; pan-and-scan crops are refused), its patches are the image cut into ``patch_size`` squares
(families.image_patches) and its text in a prompt ``\n\n<start_of_image>`` + its image tokens +
``<end_of_image>\n\n``, as transformers' ``Gemma3Processor`` writes it.

Gemma 4 keeps each image's aspect: the target is the largest size within ``max_soft_tokens * pooling_kernel_size^2``
patches whose sides are multiples of ``patch_size * pooling_kernel_size`` (its processor's rule,
:func:`gemma4_size`), taken again from the result until it stays (so the processor does not resize the PNG a second
time); its patches are the processor's (row-major, channels last) and its text ``<boi>`` + its tokens + ``<eoi>``.

Mistral 3 (Pixtral) keeps each image's aspect too: scaled down (floored) to fit ``longest_edge`` if larger, then each
side rounded *up* to a multiple of ``patch_size * spatial_merge_size`` (its processor's rule, :func:`pixtral_size`,
again taken until it stays); its text is ``[IMG]`` in the prompt, expanded to the image's rows: each row's tokens and
``[IMG_BREAK]``, the last row's ending ``[IMG_END]`` (the names from ``processor_config.json``, as Pixtral's
processor reads them).

Kimi-K2.5 / K2.6 (MoonViT) keeps each image's aspect: scaled down (never up) to fit its processor's patch budgets
(``in_patch_limit`` patches, ``patch_limit_on_one_side`` on a side: transformers' ``navit_resize``, :func:`kimi_size`),
then each side rounded to a multiple of ``patch_size * merge_kernel_size`` (floored where rounding would pass a
budget), a size its processor takes without resizing or padding; its patches are made here (rescaled, normalised
with the processor's mean and std, cut row-major into ``patch_size`` squares: transformers' processor needs
torchvision, the release's is remote code) and its text is ``<|media_begin|>image<|media_content|>`` + its tokens +
``<|media_end|>``, as the release's chat template writes it (the tokens' names read off the tokenizer).

Target size (the Qwen-VL rule): each side rounded to a multiple of ``f = patch_size * merge_size``; if the area
exceeds ``max_pixels`` both sides are scaled by sqrt(h w / max_pixels) and floored to multiples of f, if it is below
``min_pixels`` scaled up and ceiled. Aspect ratios beyond 200 are refused, as are images over ``MAX_IMAGE_BYTES``
encoded or ``MAX_IMAGE_PIXELS`` decoded (a decompression bomb), and anything PIL cannot read.

Legend: h, w = image height and width in pixels.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import io
import math
import os
import re

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forge_megatron.multimodal.families import VisionSpec

MAX_IMAGE_BYTES = 32 << 20
MAX_IMAGE_PIXELS = 64 << 20
MAX_ASPECT = 200
_DATA_URL = re.compile(r"^data:(image/[\w.+-]+)?(;[\w=.+-]+)*;base64,", re.IGNORECASE)


# Where an image part was, in a message's text until its model's image text replaces it; a text holding it is refused.
IMAGE_MARK = "\x00forge:image\x00"


class ImageError(ValueError):
    """An image that cannot be used; the message says why (the gateway answers 400 with it, naming ``param``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def content_parts(content: list, where: str, images_allowed: bool = True,
                  urls: bool = False) -> tuple[str, list]:
    """The text of OpenAI content parts with an :data:`IMAGE_MARK` per image part (``image_url`` with a data URL),
    and the images' bytes; ImageError naming the part (``param``) otherwise. ``urls``: an http(s) or file URL is
    kept as a :class:`~forge_megatron.multimodal.fetch.ImageURL` for the gateway to fetch under its policy (else
    refused: nothing is fetched)."""
    texts, images = [], []
    for j, p in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text" and isinstance(p.get("text"), str):
            if IMAGE_MARK in p["text"]:
                raise ImageError(f"{at}.text holds a NUL-delimited marker the gateway reserves", at)
            texts.append(p["text"])
        elif kind == "image_url" and images_allowed:
            url = p.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if urls and isinstance(url, str) and url.lower().startswith(("http://", "https://", "file:")):
                from forge_megatron.multimodal.fetch import ImageURL

                images.append(ImageURL(url, f"{at}.image_url"))
                texts.append(IMAGE_MARK)
                continue
            try:
                images.append(decode_data(url, f"{at}.image_url"))
            except ImageError as exc:
                raise ImageError(str(exc), f"{at}.image_url") from None
            texts.append(IMAGE_MARK)
        else:
            raise ImageError(f"{at} must be a text part {{type: 'text', text: str}}"
                             + (" or an image part {type: 'image_url', image_url: {url: 'data:image/...;base64,...'}}"
                                if images_allowed else ""), at)
    return "".join(texts), images


def decode_data(value: str, where: str = "image") -> bytes:
    """The bytes of a ``data:image/...;base64,...`` URL or of plain base64; nothing is fetched (an http(s) or file
    URL is refused; a path is not base64)."""
    if not isinstance(value, str) or not value:
        raise ImageError(f"{where} must be a data URL or base64 string")
    match = _DATA_URL.match(value)
    if match is None and value.startswith(("http://", "https://", "file:")):
        raise ImageError(f"{where}: only inline images are taken here (a data:image/...;base64 URL): URLs and paths "
                         "are not fetched (a gateway fetches them when started with --image-url-hosts or --image-dir)")
    payload = value[match.end():] if match else value
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ImageError(f"{where} is over {MAX_IMAGE_BYTES >> 20} MiB")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"{where} is not valid base64: {exc}") from None


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def open_image(data: bytes, where: str = "image"):
    """A PIL image (RGB) of encoded ``data``; ImageError for unreadable, oversized or degenerate images."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"{where} is over {MAX_IMAGE_BYTES >> 20} MiB")
    try:
        image = Image.open(io.BytesIO(data))
        w, h = image.size
        if w * h > MAX_IMAGE_PIXELS:
            raise ImageError(f"{where} has {w} x {h} pixels (over {MAX_IMAGE_PIXELS >> 20} Mi)")
        image.load()
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError(f"{where} is not a readable image: {exc}") from None
    if min(w, h) < 1 or max(w, h) / min(w, h) > MAX_ASPECT:
        raise ImageError(f"{where} is {w} x {h} pixels: aspect ratio over {MAX_ASPECT}")
    return image.convert("RGB")


def target_size(h: int, w: int, factor: int, min_pixels: int, max_pixels: int,
                upscale_small: bool = False) -> tuple[int, int]:
    """(height, width) an h x w image is resized to (the module docstring's rule; ``upscale_small``: GLM-4.xV's
    processor first scales an image with a side below ``factor`` up, keeping its aspect)."""
    if upscale_small and min(h, w) < factor:
        scale = max(factor / h, factor / w)
        h, w = int(h * scale), int(w * scale)
    hh = max(factor, round(h / factor) * factor)
    ww = max(factor, round(w / factor) * factor)
    if hh * ww > max_pixels:
        scale = math.sqrt(h * w / max_pixels)
        hh = max(factor, math.floor(h / scale / factor) * factor)
        ww = max(factor, math.floor(w / scale / factor) * factor)
    elif hh * ww < min_pixels:
        scale = math.sqrt(min_pixels / (h * w))
        hh = math.ceil(h * scale / factor) * factor
        ww = math.ceil(w * scale / factor) * factor
    return hh, ww


def gemma4_size(height: int, width: int, patch: int, max_patches: int, kernel: int) -> tuple[int, int]:
    """The size Gemma 4's image processor resizes an image to (transformers' ``get_aspect_ratio_preserving_size``):
    the aspect kept, at most ``max_patches`` patches, each side a multiple of ``patch * kernel`` (rounded down; a side
    that would vanish is one multiple, the other its aspect in multiples, within the budget's longest side)."""
    step = patch * kernel
    budget = max_patches * patch * patch
    factor = math.sqrt(budget / (height * width))
    h, w = int(math.floor(factor * height / step)) * step, int(math.floor(factor * width / step)) * step
    if h == 0 and w == 0:
        raise ValueError(f"a {height} x {width} image cannot be resized to whole {step}-pixel cells")
    longest = (max_patches // kernel ** 2) * step
    if h == 0:
        h, w = step, min(int(math.floor(width / height)) * step, longest)
    elif w == 0:
        w, h = step, min(int(math.floor(height / width)) * step, longest)
    if h * w > budget:
        raise ValueError(f"a {height} x {width} image resizes to {h} x {w}, over {max_patches} patches")
    return h, w


def navit_size(height: int, width: int, patch: int, max_patches: int, per_side: int) -> tuple[int, int]:
    """The size Kimi-K2.5's processor resizes an image to before padding (transformers' ``navit_resize``): scaled by
    the least of 1, sqrt(``max_patches`` / its whole patches) and ``per_side`` patches over each side."""
    patches = max(1, height // patch) * max(1, width // patch)
    scale = min(1.0, math.sqrt(max_patches / patches), per_side * patch / height, per_side * patch / width)
    h, w = max(1, int(height * scale)), max(1, int(width * scale))
    return min(h, per_side * patch), min(w, per_side * patch)


def kimi_size(height: int, width: int, patch: int, merge: int, max_patches: int, per_side: int) -> tuple[int, int]:
    """The normalised size of a Kimi-K2.5 image: :func:`navit_size`, each side rounded to a multiple of ``patch *
    merge`` (floored where rounding would pass a budget; at least one multiple), which its processor then keeps."""
    h, w = navit_size(height, width, patch, max_patches, per_side)
    f = patch * merge
    hh, ww = max(f, round(h / f) * f), max(f, round(w / f) * f)
    if (hh // patch) * (ww // patch) > max_patches or max(hh, ww) > per_side * patch:
        hh, ww = max(f, h // f * f), max(f, w // f * f)
    return hh, ww


def kimi_settings(model_dir: str) -> dict:
    """Kimi-K2.5's image settings from ``preprocessor_config.json``: the release's ``media_proc_cfg`` or transformers'
    ``Kimi_K25ImageProcessor`` fields, as {patch, merge, max_patches, per_side, mean, std}."""
    import json

    with open(os.path.join(model_dir, "preprocessor_config.json")) as f:
        cfg = json.load(f)
    media = cfg.get("media_proc_cfg")
    if media is not None:  # the release's processor (remote code)
        if media.get("fixed_output_tokens") is not None:
            raise ValueError(f"{model_dir}: fixed_output_tokens in media_proc_cfg is not supported")
        merge = media.get("merge_kernel_size", 2)
        out = dict(patch=media.get("patch_size", 14), merge=merge[0] if isinstance(merge, (list, tuple)) else merge,
                   max_patches=media.get("in_patch_limit", 16384), per_side=media.get("patch_limit_on_one_side", 512),
                   mean=media.get("image_mean", [0.5] * 3), std=media.get("image_std", [0.5] * 3))
    else:  # transformers' Kimi_K25ImageProcessor (its defaults where the file says nothing)
        size = cfg.get("size") or {}
        out = dict(patch=cfg.get("patch_size", 14), merge=cfg.get("merge_size", 2),
                   max_patches=cfg.get("max_patches", 16384), per_side=size.get("max_height", 512),
                   mean=cfg.get("image_mean", [0.5] * 3), std=cfg.get("image_std", [0.5] * 3))
        if cfg.get("do_normalize", True) is False or cfg.get("do_rescale", True) is False:
            raise ValueError(f"{model_dir}: an image processor without rescaling or normalisation is not supported")
    out = {k: v if k in ("mean", "std") else int(v) for k, v in out.items()}
    if out["max_patches"] < out["merge"] ** 2:
        raise ValueError(f"{model_dir}: in_patch_limit {out['max_patches']} holds no merged patch")
    return out


def pixtral_size(height: int, width: int, longest: int, step: int) -> tuple[int, int]:
    """The size Mistral 3's (Pixtral's) image processor resizes an image to (transformers'
    ``get_resize_output_image_size`` with the processor's ``patch_size * spatial_merge_size``): scaled down (floored)
    to fit ``longest`` on both sides, then each side rounded up to a multiple of ``step`` (a side the scaling would
    floor to nothing is one ``step``: the processor would make an empty image of it; it keeps the normalised one)."""
    ratio = max(height / longest, width / longest)
    if ratio > 1:
        height, width = max(1, int(math.floor(height / ratio))), max(1, int(math.floor(width / ratio)))
    return (height - 1) // step * step + step, (width - 1) // step * step + step


class ImageProcessor:
    """A checkpoint's images: normalization (gateway), token counts, and patches (engine and trainer).

    ``model_dir`` holds the vision-language checkpoint's ``config.json`` and its image processor's
    ``preprocessor_config.json`` (read from local files only)."""

    def __init__(self, model_dir: str, hf_config: dict | None = None):
        import json

        from forge_megatron.multimodal.families import vision_spec

        if hf_config is None:
            with open(os.path.join(model_dir, "config.json")) as f:
                hf_config = json.load(f)
        self.spec: VisionSpec = vision_spec(hf_config)
        if not os.path.exists(os.path.join(model_dir, "preprocessor_config.json")):
            raise ValueError(f"{model_dir} has no preprocessor_config.json: the image processor images are made with")
        self.kimi = kimi_settings(model_dir) if self.spec.kimi else None
        # (Kimi-K2.5: patches made here from its settings, see the module docstring). transformers' image processors
        # are imported here, after a text model's config was refused above (seconds of imports it has no use for).
        self.hf = None
        if not self.kimi:
            from transformers import AutoImageProcessor

            self.hf = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)
        self.square = self.spec.image_size  # Gemma 3: every image this square (0: the Qwen-VL sizes)
        if self.square:
            size = getattr(self.hf, "size", None) or {}
            if (size.get("height"), size.get("width")) != (self.square, self.square):
                raise ValueError(f"{model_dir}: the image processor makes {size.get('height')} x {size.get('width')} "
                                 f"images, the vision tower takes {self.square} x {self.square}")
            if getattr(self.hf, "do_pan_and_scan", False):
                raise ValueError(f"{model_dir}: the image processor's pan-and-scan crops are not supported (set "
                                 "do_pan_and_scan false in preprocessor_config.json)")
        if self.spec.gemma4:
            kernel, soft = int(self.hf.pooling_kernel_size), int(self.hf.max_soft_tokens)
            if kernel != self.spec.merge or int(self.hf.patch_size) != self.spec.patch_size:
                raise ValueError(f"{model_dir}: the image processor's patches ({self.hf.patch_size}, pooled "
                                 f"{kernel} x {kernel}) are not the vision tower's ({self.spec.patch_size}, pooled "
                                 f"{self.spec.merge} x {self.spec.merge})")
            self.max_patches = soft * kernel * kernel
        self.breaks = None
        if self.spec.mistral3:  # its rows' break and end tokens, as Pixtral's processor names them
            from transformers import AutoTokenizer

            names = {"image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}
            path = os.path.join(model_dir, "processor_config.json")
            if os.path.exists(path):
                with open(path) as f:
                    names.update({k: v for k, v in json.load(f).items() if k in names})
            tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
            ids = [tok.convert_tokens_to_ids(names[k]) for k in ("image_break_token", "image_end_token")]
            if None in ids or tok.unk_token_id in ids:
                raise ValueError(f"{model_dir}: the tokenizer has no {names['image_break_token']!r} / "
                                 f"{names['image_end_token']!r} tokens (Mistral 3's image rows)")
            self.breaks = tuple(ids)
            self.longest = int((getattr(self.hf, "size", None) or {}).get("longest_edge") or 1024)
        if self.kimi:
            self.patch, self.merge = self.kimi["patch"], self.kimi["merge"]
            if self.patch != self.spec.patch_size:
                raise ValueError(f"{model_dir}: the image processor's patches of {self.patch} are not the vision "
                                 f"tower's ({self.spec.patch_size})")
        else:
            self.patch = int(self.spec.patch_size or self.hf.patch_size)
            self.merge = int(getattr(self.hf, "merge_size", self.spec.merge))
        if self.merge != self.spec.merge:
            raise ValueError(f"{model_dir}: the image processor merges {self.merge} x {self.merge} patches, the model "
                             f"{self.spec.merge} x {self.spec.merge}")
        size = getattr(self.hf, "size", None) or {}
        self.min_pixels = int(size.get("shortest_edge") or getattr(self.hf, "min_pixels", 0) or 0)
        self.max_pixels = int(size.get("longest_edge") or getattr(self.hf, "max_pixels", 0) or (1 << 62))
        # GLM-4.xV's processor bounds the pixels of an image's temporal_patch_size frames (one image repeated), and
        # scales small images up first
        self.glm = type(self.hf).__name__.startswith("Glm4v")
        if self.glm:
            frames = int(getattr(self.hf, "temporal_patch_size", 1))
            self.min_pixels, self.max_pixels = self.min_pixels // frames, self.max_pixels // frames
        self._inputs = functools.lru_cache(maxsize=256)(self._image_input)
        # the tokens around an image's: Qwen's vision_start / vision_end, GLM's image_start / image_end, Gemma's
        # boi / eoi
        self.vision_start = next((hf_config[k] for k in ("vision_start_token_id", "image_start_token_id",
                                                         "boi_token_index", "boi_token_id") if k in hf_config), None)
        self.vision_end = next((hf_config[k] for k in ("vision_end_token_id", "image_end_token_id", "eoi_token_index",
                                                       "eoi_token_id") if k in hf_config), None)

    def placeholder(self, tokenizer) -> str | None:
        """The text of one image in a prompt (``<|vision_start|><|image_pad|><|vision_end|>``; GLM-4.xV's
        ``<|begin_of_image|><|image|><|end_of_image|>``), or None when the tokenizer does not give those three tokens
        back as themselves."""
        if self.breaks is not None:  # Mistral 3: [IMG], expanded to the image's rows
            ids = [self.spec.image_token_id]
        elif self.vision_start is None or self.vision_end is None:
            return None
        else:
            ids = [self.vision_start, self.spec.image_token_id, self.vision_end]
            content = tokenizer.convert_tokens_to_ids("<|media_content|>") if self.kimi else None
            if content is not None and content != tokenizer.unk_token_id:  # Kimi's "image" then the content token
                ids = [self.vision_start, *tokenizer.encode("image", add_special_tokens=False), content,
                       self.spec.image_token_id, self.vision_end]
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if tokenizer.encode(text, add_special_tokens=False) != ids:
            return None
        return f"\n\n{text}\n\n" if self.square else text  # (Gemma3Processor's blank lines around an image)

    def expand(self, ids: list[int], images: list[bytes], start: int = 0, first: int = 0) -> list[int]:
        """``ids`` with each image placeholder token from ``start`` on made the token count of ``images[first:]`` in
        turn; ValueError when their numbers differ."""
        return list(ids[:start]) + self._written_out(
            ids[start:], [self.grid(x) for x in images[first:]],
            "the prompt has {n} image placeholder(s) for {k} image(s): does a text hold the model's image token?")

    def image_ids(self, data: bytes) -> list[int]:
        """The tokens of normalized ``data`` in a prompt: its image tokens (Mistral 3: row by row, each row ending
        with the break token, the last with the end token)."""
        return self.image_ids_of(self.grid(data))

    def image_ids_of(self, grid) -> list[int]:
        """:meth:`image_ids` of an image of ``grid`` (t, h, w) patches."""
        pad = self.spec.image_token_id
        if self.breaks is None:
            return [pad] * self.spec.tokens_per_image(grid)
        rows, cols = self.spec.rows_of_image(grid)
        out = []
        for r in range(rows):
            out += [pad] * cols + [self.breaks[1] if r == rows - 1 else self.breaks[0]]
        return out

    def engine_ids(self, ids: list[int], grids: list) -> list[int]:
        """``ids`` (each image's tokens written out, as the trajectory records them) as an engine's ``/generate``
        takes them with ``image_data``: one placeholder per image, which the engine writes out again, every other
        token kept as it is. Each image's run of image tokens becomes one image token (Qwen-VL, GLM-4.xV, Gemma 3 / 4
        between their image start / end tokens, Kimi-K2.5: SGLang's token-id expansion, which keeps the other tokens
        verbatim); Mistral 3's rows, breaks and end one ``[IMG]`` (its processor writes the rows). SGLang refuses,
        or garbles, images written out (docs/rollout.md). ``grids``: the images' (t, h, w) patch grids."""
        if not grids:
            return list(ids)
        from forge_megatron.multimodal.families import image_token_spans

        out, cursor = [], 0
        for rows in image_token_spans(ids, grids, self.spec):
            start, end = rows[0][0], rows[-1][1] + (1 if self.breaks is not None else 0)  # (Mistral 3: its end)
            out += ids[cursor:start] + [self.spec.image_token_id]
            cursor = end
        return out + ids[cursor:]

    def expand_placeholders(self, ids: list[int], grids: list) -> list[int]:
        """The inverse of :meth:`engine_ids` (an engine's): each image's placeholder written out for its grid (its
        image tokens; Mistral 3's rows); ValueError when there is not one placeholder per image."""
        return self._written_out(ids, grids, "input_ids hold {n} image placeholder token(s) for {k} image(s): the "
                                             "engine takes one placeholder token per image and writes the image out "
                                             "itself")

    def _written_out(self, ids: list[int], grids: list, problem: str) -> list[int]:
        """``ids`` with the i-th image token made image i's tokens (:meth:`image_ids_of`); ValueError(``problem``,
        formatted with the placeholders ``n`` and images ``k``) when their numbers differ."""
        pad = self.spec.image_token_id
        if ids.count(pad) != len(grids):
            raise ValueError(problem.format(n=ids.count(pad), k=len(grids)))
        out, k = [], 0
        for t in ids:
            if t == pad:
                out += self.image_ids_of(grids[k])
                k += 1
            else:
                out.append(t)
        return out

    @property
    def factor(self) -> int:
        return self.patch * self.merge

    def normalize(self, data: bytes, where: str = "image") -> bytes:
        """The PNG of ``data`` at its target size (the bytes every later stage uses)."""
        from PIL import Image

        image = open_image(data, where)
        if self.square:  # with the processor's own filter: its resize of the result is then none
            h = w = self.square
            resample = Image.Resampling(int(getattr(self.hf, "resample", Image.Resampling.BILINEAR)))
        elif self.spec.gemma4 or self.spec.mistral3 or self.kimi:
            h, w = self._fixed_size(image.height, image.width, where)
            resample = Image.Resampling(int(getattr(self.hf, "resample", Image.Resampling.BICUBIC)))
        else:
            h, w = target_size(image.height, image.width, self.factor, self.min_pixels, self.max_pixels, self.glm)
            resample = Image.Resampling.BICUBIC
        if (h, w) != (image.height, image.width):
            image = image.resize((w, h), resample=resample)
        out = io.BytesIO()
        image.save(out, format="PNG")
        return out.getvalue()

    def _fixed_size(self, height: int, width: int, where: str = "image") -> tuple[int, int]:
        """Gemma 4's (:func:`gemma4_size`), Mistral 3's (:func:`pixtral_size`) or Kimi-K2.5's (:func:`kimi_size`)
        size for an image of ``height`` x ``width``, taken again from the result until it stays (a few steps: Gemma
        4's sizes only grow within the budget; Pixtral's and Kimi's stay after one)."""
        size = (height, width)
        for _ in range(64):
            try:
                if self.kimi:
                    k = self.kimi
                    nxt = kimi_size(*size, self.patch, self.merge, k["max_patches"], k["per_side"])
                elif self.spec.gemma4:
                    nxt = gemma4_size(*size, self.patch, self.max_patches, self.spec.merge)
                else:
                    nxt = pixtral_size(*size, self.longest, self.patch * self.merge)
            except ValueError as exc:
                raise ImageError(f"{where}: {exc}") from None
            if nxt == size:
                return size
            size = nxt
        return size

    def grid(self, data: bytes) -> tuple[int, int, int]:
        """The (t, h, w) patch grid of normalized ``data`` (its size read off the header: nothing is decoded)."""
        from PIL import Image

        try:
            width, height = Image.open(io.BytesIO(data)).size
        except (OSError, ValueError) as exc:
            raise ImageError(f"image is not a readable image: {exc}") from None
        if self.square:
            return 1, self.square // self.patch, self.square // self.patch
        if self.spec.gemma4 or self.spec.mistral3 or self.kimi:
            h, w = self._fixed_size(height, width)
            return 1, h // self.patch, w // self.patch
        h, w = target_size(height, width, self.factor, self.min_pixels, self.max_pixels, self.glm)
        return 1, h // self.patch, w // self.patch

    def num_tokens(self, data: bytes) -> int:
        return self.spec.tokens_per_image(self.grid(data))

    def image_input(self, item):
        """An item of ``TrainSample.images`` as the vision tower takes it: an ImageInput as it is, encoded bytes
        through the checkpoint's processor (cached by content)."""
        from forge_megatron.multimodal.tree import ImageInput

        if isinstance(item, ImageInput):
            return item
        return self._inputs(bytes(item))

    def _image_input(self, data: bytes):
        from forge_megatron.multimodal.tree import ImageInput

        if self.kimi:  # rescaled, normalised, cut row-major into patches (Kimi-K2.5's processor on its own size)
            import numpy as np
            import torch

            from forge_megatron.multimodal.families import image_patches

            image, grid = open_image(data), self.grid(data)
            if (image.height, image.width) != (grid[1] * self.patch, grid[2] * self.patch):
                raise ImageError(f"a {image.width} x {image.height} image is not normalised for Kimi-K2.5 (its size "
                                 f"would be {grid[2] * self.patch} x {grid[1] * self.patch})")
            x = np.asarray(image, dtype=np.float32) / 255.0
            x = (x - np.asarray(self.kimi["mean"], np.float32)) / np.asarray(self.kimi["std"], np.float32)
            pixels = torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))[None]
            return ImageInput(image_patches(pixels, self.patch).numpy(), grid)

        if self.spec.mistral3:  # (its processor merges patches: sizes in whole merged patches, as Pixtral's does)
            step = self.patch * self.merge
            out = self.hf(images=[open_image(data)], patch_size={"height": step, "width": step}, return_tensors="np")
        else:
            out = self.hf(images=[open_image(data)], return_tensors="np")
        if self.square or self.spec.mistral3:
            import torch

            from forge_megatron.multimodal.families import image_patches

            pixels = out["pixel_values"]
            grid = self.grid(data)
            want = (1, 3, grid[1] * self.patch, grid[2] * self.patch)
            if pixels.shape != want:
                raise ImageError(f"the image processor made pixel values of shape {pixels.shape} of one image "
                                 f"normalised for {want}")
            patches = image_patches(torch.from_numpy(pixels.astype("float32")), self.patch).numpy()
            return ImageInput(patches, self.grid(data))
        if self.spec.gemma4:  # its patches without the padding, checked to be row-major as the tower takes them
            import numpy as np

            grid = self.grid(data)
            n = grid[1] * grid[2]
            positions = out["image_position_ids"][0]
            ys, xs = np.meshgrid(np.arange(grid[1]), np.arange(grid[2]), indexing="ij")
            if n > positions.shape[0] or not (positions[:n] == np.stack([xs.ravel(), ys.ravel()], -1)).all() \
                    or (positions[n:] != -1).any():
                raise ImageError(f"the image processor's patches are not the {grid[1]} x {grid[2]} grid of an image "
                                 "normalised for it")
            return ImageInput(out["pixel_values"][0, :n].astype("float32"), grid)
        grid, want = tuple(int(x) for x in out["image_grid_thw"][0]), self.grid(data)
        if grid != want:
            raise ImageError(f"the image processor made a {grid} grid of an image normalized to {want} "
                             "(its size settings differ from the ones read off preprocessor_config.json)")
        return ImageInput(out["pixel_values"].astype("float32"), grid)
