"""Image preprocessing for the vision tower (SPEC §12), shared by training and serving (Pillow).

    decode_image(bytes)            PNG, JPEG or WebP -> an RGB PIL image; anything else raises ImageError
    fit_size(height, width, vc)    the size the image is resized to (below)
    prepare_image(image, vc)       resize, patchify, normalise -> PreparedImage (one image's ImageBatch, its
                                   token count and its content digest)
    ImageBatch.pack([...])         several prepared images of different sizes in one batch, without padding

Size (unit u = patch_size * merge_size = 28 in K3): with s = min(1, sqrt(max_pixels / (H0 * W0))) the image is
scaled by s (shrunk into the budget, never enlarged; aspect ratio kept) and each side rounded down to a multiple
of u, but at least u (a side shorter than u is stretched to u). Only when a side was raised to u can the area
exceed the budget; the other side is then cut to fit. So
H * W <= max_pixels always, and the image gives (H / u) * (W / u) image tokens: (H/14) x (W/14) patches merged 2 x 2.
Example (K3, max_pixels = 4096 * 196): a 1920 x 1080 (width x height) photo -> s = 0.6222 -> 1194.7 x 672 ->
1176 x 672 -> 42 * 24 = 1008 image tokens; a 20 x 30 icon -> 28 x 28 -> 1 token.

Pixels: RGB (alpha dropped), bicubic resampling, scaled to [-1, 1] (mean 0.5, std 0.5 per channel). Patches are
flattened channel-major (c, y, x) in raster order of the patch grid, the layout openk3.model.vision expects.

Content digest: blake2b of the resized pixels and their size, so two requests carrying the same picture (in any
container: PNG or lossless WebP) share one prefix-cache identity, and different pictures never do
(openk3.serve.prefix_cache.image_keyed_tokens).
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from openk3.config import VisionConfig
from openk3.model.vision import ImageBatch

FORMATS = ("PNG", "JPEG", "WEBP")
MAX_INPUT_PIXELS = 32 << 20  # larger images are refused before decoding (a small PNG can declare a huge canvas)


class ImageError(ValueError):
    """An image that cannot be used; the message says why (the server answers 400 with it)."""


@dataclass
class PreparedImage:
    batch: ImageBatch  # this image alone: patches [h*w, 3*p*p], grid ((h, w),)
    num_tokens: int  # image tokens it becomes: (h / merge) * (w / merge)
    digest: bytes  # 8-byte content hash of the resized pixels


def decode_image(data: bytes, max_input_pixels: int = MAX_INPUT_PIXELS) -> Image.Image:
    """Bytes of a PNG, JPEG or WebP file -> an RGB image. ImageError for another format, a file that does not
    decode, or a canvas of more than max_input_pixels (checked from the header, before decoding)."""
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:  # its message names Pillow's file object, nothing of the user's
        raise ImageError("not a readable image (not a PNG, JPEG or WebP file)") from None
    except OSError as exc:
        raise ImageError(f"not a readable image ({exc})") from None
    except Image.DecompressionBombError:
        raise ImageError(f"the image declares more than {max_input_pixels} pixels") from None
    if image.format not in FORMATS:
        raise ImageError(f"unsupported image format {image.format}; send PNG, JPEG or WebP")
    width, height = image.size
    if width * height > max_input_pixels:
        raise ImageError(f"the image is {width} x {height} = {width * height} pixels, more than the "
                         f"{max_input_pixels} accepted")
    try:
        image.load()
    except Exception as exc:  # truncated or corrupt data raises OSError, ValueError, SyntaxError, ... by codec
        raise ImageError(f"the {image.format} data is corrupt ({exc})") from None
    return image.convert("RGB")


def fit_size(height: int, width: int, vc: VisionConfig) -> tuple[int, int]:
    """(H, W) to resize an image of height x width pixels to (module docstring): multiples of vc.unit, within
    vc.max_pixels, aspect ratio kept up to the rounding."""
    if height < 1 or width < 1:
        raise ImageError(f"the image is {width} x {height} pixels")
    u = vc.unit
    scale = min(1.0, (vc.max_pixels / (height * width)) ** 0.5)
    h, w = (max(u, int(side * scale) // u * u) for side in (height, width))
    if h * w > vc.max_pixels:  # one side was raised to u: cut the other
        if h == u:
            w = vc.max_pixels // u // u * u
        else:
            h = vc.max_pixels // u // u * u
    return h, w


def image_token_count(height: int, width: int, vc: VisionConfig) -> int:
    """Image tokens an image of height x width pixels becomes: (H / u) * (W / u) at its fitted size."""
    h, w = fit_size(height, width, vc)
    return (h // vc.unit) * (w // vc.unit)


def patchify(pixels: np.ndarray, patch: int) -> torch.Tensor:
    """uint8 pixels [H, W, 3] (H, W multiples of patch) -> patches [(H/p)(W/p), 3*p*p] in [-1, 1], channel-major."""
    H, W, _ = pixels.shape
    x = torch.from_numpy(np.array(pixels)).permute(2, 0, 1).float() / 127.5 - 1.0  # [3, H, W] (a writable copy)
    x = x.view(3, H // patch, patch, W // patch, patch).permute(1, 3, 0, 2, 4)  # [h, w, 3, p, p]
    return x.reshape((H // patch) * (W // patch), 3 * patch * patch)


def prepare_image(image: Image.Image, vc: VisionConfig) -> PreparedImage:
    """Resize into the budget, patchify, normalise (module docstring)."""
    H, W = fit_size(image.height, image.width, vc)
    if (image.height, image.width) != (H, W):
        image = image.resize((W, H), Image.Resampling.BICUBIC)  # PIL sizes are (width, height)
    pixels = np.asarray(image.convert("RGB"), dtype=np.uint8)
    digest = hashlib.blake2b(f"{H}x{W}:".encode() + pixels.tobytes(), digest_size=8).digest()
    h, w = H // vc.patch_size, W // vc.patch_size
    return PreparedImage(ImageBatch(patchify(pixels, vc.patch_size), ((h, w),)), (H // vc.unit) * (W // vc.unit),
                         digest)
