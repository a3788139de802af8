"""Images in chat requests: OpenAI `image_url` content parts -> prepared images and their placeholder runs.

A part `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` carries the picture inline (PNG,
JPEG or WebP). The server fetches nothing: an http(s) or any other non-data URL is refused with a 400 naming the
field, as are a malformed data URL, bad base64, a file that does not decode, another format, a canvas over
openk3.images.MAX_INPUT_PIXELS, and any image sent to a model without a vision tower. In the prompt the image
becomes its run of placeholder ids (`vision.image_token_id`, one per image token: (H/28) * (W/28) after
openk3.images resized it into `vision.max_pixels`), where the part was in the message.
"""

from __future__ import annotations

import base64
import binascii
import re

from openk3.config import ModelConfig
from openk3.images import ImageError, PreparedImage, decode_image, prepare_image
from openk3.serve.schema import APIError, ChatBody

DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                      re.ASCII)


def image_from_url(url: str, cfg: ModelConfig, param: str) -> PreparedImage:
    """A data: URL -> the prepared image; APIError 400 naming `param` for anything else (module docstring)."""
    def refuse(message: str, code: str = "invalid_image") -> APIError:
        return APIError(400, f"{param}: {message}", param, code)

    if cfg.vision is None:
        raise refuse(f"the model {cfg.name!r} has no vision tower: it takes no images", "images_not_supported")
    head = DATA_URL.match(url)
    if head is None:
        scheme = url.split(":", 1)[0] if ":" in url else url[:16]
        raise refuse(f"only inline images are accepted (a data: URL with base64 PNG, JPEG or WebP); this server "
                     f"fetches nothing, so a {scheme!r} URL cannot be used", "invalid_image_url")
    if not head["b64"]:
        raise refuse("the data: URL must be base64-encoded (data:image/png;base64,...)", "invalid_image_url")
    try:
        data = base64.b64decode(url[head.end():], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise refuse(f"the base64 payload does not decode ({exc})") from None
    try:
        return prepare_image(decode_image(data), cfg.vision)
    except ImageError as exc:
        raise refuse(str(exc)) from None


def chat_messages(body: ChatBody, cfg: ModelConfig) -> tuple[list[dict], list[PreparedImage]]:
    """The messages for openk3.tokenizer.encode_chat (an image part becomes its placeholder ids) and the images
    in prompt order."""
    messages, images = [], []
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            continue
        parts: list = []
        for j, part in enumerate(m.content):
            if part.type == "text":
                parts.append(part.text)
            else:
                image = image_from_url(part.image_url.url, cfg, f"messages.{i}.content.{j}.image_url.url")
                images.append(image)
                parts.append([cfg.vision.image_token_id] * image.num_tokens)
        messages.append({"role": m.role, "content": parts})
    return messages, images
