"""Images in chat requests: OpenAI `image_url` content parts -> prepared images and their placeholder runs.

A part `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` carries the picture inline (PNG,
JPEG or WebP). By default the server fetches nothing: an http(s) or any other non-data URL is refused with a 400
naming the field. With `openk3 serve --allow-remote-images` (a `RemoteImages` policy) http(s) URLs are fetched,
within a time limit and a byte limit, without following redirects; a failed fetch (timeout, an HTTP error status,
a body over the limit) is a 400 that says why. Also refused with a 400: a malformed data URL, bad base64, a file
that does not decode, another format, a canvas over openk3.images.MAX_INPUT_PIXELS, and any image sent to a
model without a vision tower. In the prompt the image
becomes its run of placeholder ids (`vision.image_token_id`, one per image token: (H/28) * (W/28) after
openk3.images resized it into `vision.max_pixels`), where the part was in the message.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

import httpx

from openk3.config import ModelConfig
from openk3.images import ImageError, PreparedImage, decode_image, prepare_image
from openk3.serve.schema import APIError, ChatBody

DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                      re.ASCII)


@dataclass(frozen=True)
class RemoteImages:
    """Whether and within which limits http(s) image URLs are fetched (`openk3 serve --allow-remote-images`)."""

    max_bytes: int = 20 << 20
    timeout_s: float = 10.0

    def fetch(self, url: str) -> bytes:
        """The body at `url`; ValueError saying why when it cannot be had within the limits."""
        try:
            with httpx.stream("GET", url, timeout=self.timeout_s, follow_redirects=False) as reply:
                if reply.status_code != 200:
                    raise ValueError(f"fetching it gave HTTP {reply.status_code}")
                data = bytearray()
                for chunk in reply.iter_bytes():
                    data += chunk
                    if len(data) > self.max_bytes:
                        raise ValueError(f"it is larger than the {self.max_bytes >> 20} MiB this server fetches")
                return bytes(data)
        except httpx.TimeoutException:
            raise ValueError(f"fetching it took longer than {self.timeout_s:g} s") from None
        except httpx.HTTPError as exc:
            raise ValueError(f"fetching it failed ({type(exc).__name__})") from None


def image_from_url(url: str, cfg: ModelConfig, param: str, remote: RemoteImages | None = None) -> PreparedImage:
    """A data: URL (or, with a `remote` policy, an http(s) URL) -> the prepared image; APIError 400 naming `param`
    for anything else (module docstring)."""
    def refuse(message: str, code: str = "invalid_image") -> APIError:
        return APIError(400, f"{param}: {message}", param, code)

    if cfg.vision is None:
        raise refuse(f"the model {cfg.name!r} has no vision tower: it takes no images", "images_not_supported")
    head = DATA_URL.match(url)
    if head is None:
        scheme = url.split(":", 1)[0] if ":" in url else url[:16]
        if remote is None:
            raise refuse(f"only inline images are accepted (a data: URL with base64 PNG, JPEG or WebP); this server "
                         f"fetches nothing (start it with --allow-remote-images to fetch http(s) URLs), so a "
                         f"{scheme!r} URL cannot be used", "invalid_image_url")
        if scheme not in ("http", "https"):
            raise refuse(f"an image URL must be a data: or an http(s) URL, not a {scheme!r} URL", "invalid_image_url")
        try:
            data = remote.fetch(url)
        except ValueError as exc:
            raise refuse(f"the image at {url[:200]} could not be used: {exc}", "image_fetch_failed") from None
    elif not head["b64"]:
        raise refuse("the data: URL must be base64-encoded (data:image/png;base64,...)", "invalid_image_url")
    else:
        try:
            data = base64.b64decode(url[head.end():], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise refuse(f"the base64 payload does not decode ({exc})") from None
    try:
        return prepare_image(decode_image(data), cfg.vision)
    except ImageError as exc:
        raise refuse(str(exc)) from None


def chat_messages(body: ChatBody, cfg: ModelConfig,
                  remote: RemoteImages | None = None) -> tuple[list[dict], list[PreparedImage]]:
    """The messages for openk3.tokenizer.encode_chat (an image part becomes its placeholder ids) and the images
    in prompt order."""
    messages, images = [], []
    for i, m in enumerate(body.messages):
        if m.content is None or isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content or ""})
            continue
        parts: list = []
        for j, part in enumerate(m.content):
            if part.type == "text":
                parts.append(part.text)
            else:
                image = image_from_url(part.image_url.url, cfg, f"messages.{i}.content.{j}.image_url.url", remote)
                images.append(image)
                parts.append([cfg.vision.image_token_id] * image.num_tokens)
        messages.append({"role": m.role, "content": parts})
    return messages, images
