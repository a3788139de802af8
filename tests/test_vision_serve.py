"""Images in serving: the prefix cache keys image blocks by pixel content, the engine prefills image prompts in
chunks (with and without a hit) exactly like one full forward, and a real server takes OpenAI image_url parts
from the official client (prompt tokens grow with the image, a repeated image hits the cache) and refuses bad
images with a 400 naming the field while it keeps serving; with --allow-remote-images it fetches http(s) images
within its limits from a local HTTP server."""

import base64
import http.server
import io
import threading
import time

import httpx
import openai
import pytest
import torch
from PIL import Image

from openk3.config import get_preset
from openk3.images import prepare_image
from openk3.model import K3ForCausalLM
from openk3.sampling import SamplingParams
from openk3.serve.engine import Engine, EngineConfig
from openk3.serve.prefix_cache import image_keyed_tokens
from openk3.serve.schema import APIError, ChatBody
from openk3.serve.vision import RemoteImages, chat_messages, image_from_url
from openk3.tokenizer import ByteTokenizer, encode_chat
from random_weights import randomise
from serve_process import inprocess_server, o1_checkpoint, serve_process
from train_tiny import one_thread

MODEL = "k3-tiny-vl"


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield
H = 16  # the engines' hash block


def picture(width: int, height: int, seed: int) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8).numpy())


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def chat(*parts, text: str = "Describe the picture.") -> list[dict]:
    content = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": p}} for p in parts]
    return [{"role": "user", "content": content}]


# ---- the prefix cache's identity of an image -----------------------------------------------------------------

def test_image_blocks_are_keyed_by_content_not_by_placeholder():
    img = 9
    prompt = [1, 2, img, img, img, 3, img, img, 4]
    a, b = bytes(range(8)), bytes(range(1, 9))
    keyed = image_keyed_tokens(prompt, img, [(3, a), (2, b)])
    assert keyed[:2] == [1, 2] and keyed[5] == 3 and keyed[8] == 4
    assert len(set(keyed[2:5])) == 1 and len(set(keyed[6:8])) == 1 and keyed[2] != keyed[6]
    assert all(k < 0 for k in keyed[2:5] + keyed[6:8])  # never a token id
    assert image_keyed_tokens(prompt, img, [(3, a), (2, b)]) == keyed  # stable
    assert image_keyed_tokens(prompt, img, [(3, b), (2, a)])[2] == keyed[6]  # the key follows the content
    for images in ([(3, a)], [(3, a), (3, b)], []):
        with pytest.raises(ValueError, match="placeholders"):
            image_keyed_tokens(prompt, img, images)
    assert image_keyed_tokens([1, 2], img, []) == [1, 2]


# ---- the engine ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vl_model():
    cfg = get_preset("k3-tiny-vl").with_overrides({"mtp_layers": 0, "max_seq_len": 512})
    model = K3ForCausalLM(cfg)
    randomise(model, seed=3)
    return model.eval()


def image_request(model, tokenizer, images, text="Look at this picture, and at the next one, carefully:"):
    cfg = model.config
    prepared = [prepare_image(im, cfg.vision) for im in images]
    content = [text] + [[cfg.vision.image_token_id] * p.num_tokens for p in prepared] + [" what is it?"]
    return encode_chat(tokenizer, [{"role": "user", "content": content}]), prepared


def run(engine, prompt, images, max_tokens=4):
    request = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                                 images=images)
    while engine.has_work():
        engine.step()
    return request


def test_engine_image_prompts_hit_by_content_and_match_a_full_forward(vl_model):
    tok = ByteTokenizer()
    engine = Engine(vl_model, tok, EngineConfig(hash_block=H, prefill_chunk_blocks=1))  # chunks cut images
    cold = Engine(vl_model, tok, EngineConfig(prefix_cache=False, hash_block=H, prefill_chunk_blocks=3))
    pic, other = picture(112, 56, seed=1), picture(112, 56, seed=2)  # 8 image tokens each
    prompt, prepared = image_request(vl_model, tok, [pic, picture(56, 84, seed=3)])
    first, again, no_cache = (run(e, prompt, prepared) for e in (engine, engine, cold))
    with torch.no_grad():
        full = vl_model(torch.tensor([prompt + first.output[:-1]]),
                        images=type(prepared[0].batch).pack([p.batch for p in prepared])).logits[0]
    greedy = full[len(prompt) - 1:, :tok.vocab_size].argmax(-1).tolist()  # the engine samples within the tokenizer
    assert first.output == greedy == no_cache.output == again.output
    assert first.cached_tokens == 0 and again.cached_tokens == H * ((len(prompt) - 1) // H)
    # the same prompt with another picture of the same size: only the text before the images can hit
    prompt2, prepared2 = image_request(vl_model, tok, [other, picture(56, 84, seed=3)])
    assert prompt2 == prompt
    changed = run(engine, prompt2, prepared2)
    first_image = prompt.index(vl_model.config.vision.image_token_id)
    assert changed.cached_tokens == H * (first_image // H) > 0
    assert changed.output == run(cold, prompt2, prepared2).output


def test_engine_batches_image_prefills_and_choices_share_the_images(vl_model):
    """Two image prompts of one length prefill in the same forward (their image tokens concatenated row by row)
    beside a text prompt, and a second choice of the first (`after`) hits its images by content: every output is
    what the same request gives alone on a cold engine."""
    tok = ByteTokenizer()
    engine = Engine(vl_model, tok, EngineConfig(hash_block=H, prefill_chunk_blocks=2))
    cold = Engine(vl_model, tok, EngineConfig(prefix_cache=False, hash_block=H, prefill_chunk_blocks=2))
    a = image_request(vl_model, tok, [picture(84, 56, seed=10), picture(56, 56, seed=11)])
    b = image_request(vl_model, tok, [picture(84, 56, seed=12), picture(56, 56, seed=13)])
    text = (tok.encode("no picture here, just some text to read"), [])
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    assert len(a[0]) == len(b[0])
    seen = []
    forward_steps = engine.runner.forward_steps

    def spy(chunks, *args, image_embeds=None, **kwargs):
        seen.append((len(chunks), 0 if image_embeds is None else image_embeds.shape[0]))
        return forward_steps(chunks, *args, image_embeds=image_embeds, **kwargs)

    engine.runner.forward_steps = spy
    first = engine.add_request(a[0], params, images=a[1])
    others = [engine.add_request(p, params, images=im) for p, im in (b, text)]
    choice = engine.add_request(a[0], params, images=a[1], after=first)
    while engine.has_work():
        engine.step()
    assert any(rows == 2 and n > 0 for rows, n in seen)  # a and b in one forward, with their image tokens
    assert [r.output for r in (first, *others, choice)] == [run(cold, p, im, 3).output for p, im in (a, b, text, a)]
    assert choice.cached_tokens == H * ((len(a[0]) - 1) // H) > a[0].index(vl_model.config.vision.image_token_id)
    assert first.images is None and choice.images is None  # dropped when they finish


def test_an_image_alone_is_served_the_prompt_the_captioner_trained_on(vl_model):
    """`openk3 train --preset k3-tiny-vl` trains on the chat template of a user message holding the image alone
    (train/shapes.py): a chat request whose content is that image, with no text part, gets exactly that prompt,
    and at temperature 0 the greedy continuation of it (by full forwards, over the tokenizer's words as the engine
    samples), token for token."""
    from openk3.train.shapes import IGNORE, caption_tokenizer, draw, held_out_scenes, make_batch

    tok, scene = caption_tokenizer(), held_out_scenes(1)[0]
    batch = make_batch([scene], tok, vl_model.config.vision)
    prompt = batch.inputs[0, :int((batch.targets[0] != IGNORE).nonzero()[0]) + 1].tolist()
    ids: list[int] = []
    with torch.no_grad():
        for _ in range(4):  # a caption's four words
            logits = vl_model(torch.tensor([prompt + ids]), images=batch.images).logits[0, -1, :tok.vocab_size]
            ids.append(int(logits.argmax()))
    with inprocess_server(Engine(vl_model, tok, EngineConfig(hash_block=H)), MODEL) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        image = {"type": "image_url", "image_url": {"url": data_url(draw(scene))}}
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [image]}],
                                           temperature=0, max_tokens=4, logprobs=True,
                                           extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(prompt)
    assert [entry.token for entry in r.choices[0].logprobs.content] == [tok.tokenizer.id_to_token(i) for i in ids]
    assert r.choices[0].message.content == tok.decode_plain(ids)


def test_engine_refuses_placeholders_without_their_images(vl_model):
    tok = ByteTokenizer()
    engine = Engine(vl_model, tok, EngineConfig(hash_block=H))
    prompt, prepared = image_request(vl_model, tok, [picture(56, 56, seed=4)])
    for images, reason in (([], "placeholders"), (prepared * 2, "placeholders")):
        with pytest.raises(ValueError, match=reason):
            engine.add_request(prompt, SamplingParams(max_tokens=1), images=images)


def test_images_for_a_text_model_and_remote_urls_are_refused_naming_the_field():
    body = ChatBody.model_validate({"model": "m", "messages": chat(data_url(picture(28, 28, 0)))})
    param = "messages.0.content.1.image_url.url"
    with pytest.raises(APIError, match="no vision tower") as exc:
        chat_messages(body, get_preset("k3-tiny"))
    assert exc.value.status == 400 and exc.value.param == param
    for url, reason in [("https://example.com/cat.png", "fetches nothing"), ("data:image/png,abc", "base64"),
                        ("data:image/png;base64,not base64!", "does not decode")]:
        with pytest.raises(APIError, match=reason) as exc:
            image_from_url(url, get_preset("k3-tiny-vl"), param)
        assert exc.value.status == 400 and exc.value.param == param


@pytest.fixture(scope="module")
def image_host():
    """A local HTTP server: /ok.png a picture, /slow.png the same after 2 s, anything else 404; yields its URL."""
    body = io.BytesIO()
    picture(56, 84, seed=9).save(body, "PNG")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 -- the http.server API
            if self.path not in ("/ok.png", "/slow.png"):
                self.send_error(404)
                return
            if self.path == "/slow.png":
                time.sleep(2)
            try:
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.end_headers()
                self.wfile.write(body.getvalue())
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (the timeout case)
                pass

        def log_message(self, *args):
            pass

    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{host.server_address[1]}"
    host.shutdown()


def test_remote_images_only_with_the_policy_and_within_its_limits(image_host):
    cfg, param = get_preset("k3-tiny-vl"), "messages.0.content.1.image_url.url"
    fetched = image_from_url(f"{image_host}/ok.png", cfg, param, RemoteImages())
    assert fetched.num_tokens == prepare_image(picture(56, 84, seed=9), cfg.vision).num_tokens
    cases = [(f"{image_host}/ok.png", None, "fetches nothing"),
             (f"{image_host}/missing.png", RemoteImages(), "HTTP 404"),
             (f"{image_host}/ok.png", RemoteImages(max_bytes=100), "larger than"),
             (f"{image_host}/slow.png", RemoteImages(timeout_s=0.5), "longer than"),
             ("ftp://example.com/a.png", RemoteImages(), "not a 'ftp' URL")]
    for url, policy, reason in cases:
        with pytest.raises(APIError, match=reason) as exc:
            image_from_url(url, cfg, param, policy)
        assert exc.value.status == 400 and exc.value.param == param


# ---- a real server and the official client -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    return o1_checkpoint(tmp_path_factory.mktemp("o1-k3-tiny-vl"), preset="k3-tiny-vl")


@pytest.fixture(scope="module")
def server(vl_checkpoint):
    with serve_process("--ckpt", vl_checkpoint, "--model-name", MODEL) as (url, _):
        yield url


def test_a_server_with_remote_images_fetches_them(vl_checkpoint, image_host):
    with serve_process("--ckpt", vl_checkpoint, "--model-name", MODEL, "--allow-remote-images") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        remote = client.chat.completions.create(model=MODEL, messages=chat(f"{image_host}/ok.png"), max_tokens=2,
                                                temperature=0)
        inline = client.chat.completions.create(model=MODEL, messages=chat(data_url(picture(56, 84, seed=9))),
                                                max_tokens=2, temperature=0)
        assert remote.usage.prompt_tokens == inline.usage.prompt_tokens  # the same picture, fetched or inline
        assert remote.choices[0].message.content == inline.choices[0].message.content
        missing = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                             json={"model": MODEL, "messages": chat(f"{image_host}/missing.png"), "max_tokens": 1})
        assert missing.status_code == 400 and "HTTP 404" in missing.json()["error"]["message"]


def test_openai_client_image_prompts_count_image_tokens_and_hit_the_cache(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)
    ask = lambda messages: client.chat.completions.create(  # noqa: E731
        model=MODEL, messages=messages, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    small, large = picture(56, 56, seed=5), picture(112, 84, seed=6)  # (2 x 2) and (3 x 4) image tokens
    text_only = ask(chat()).usage.prompt_tokens
    first = ask(chat(data_url(large)))
    assert first.usage.prompt_tokens == text_only + 12 and ask(chat(data_url(small))).usage.prompt_tokens == \
        text_only + 4
    again = ask(chat(data_url(large, "WEBP")))  # lossy WebP: other pixels, so no hit past the text
    same = ask(chat(data_url(large)))
    assert same.usage.prompt_tokens_details.cached_tokens == H * ((first.usage.prompt_tokens - 1) // H) > 0
    assert same.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens < same.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("url, reason", [
    ("http://example.com/a.png", "fetches nothing"),
    ("data:image/png;base64," + base64.b64encode(b"hello, not an image").decode(), "not a readable image"),
    (data_url(picture(30, 30, 7), "GIF"), "unsupported image format GIF"),
    ("data:image/png;base64," + data_url(picture(64, 64, 8)).split(",")[1][:200], "corrupt"),
    ("data:image/png;base64,@@@", "does not decode"),
])
def test_bad_images_get_a_400_naming_the_field_and_the_server_stays_up(server, url, reason):
    body = {"model": MODEL, "messages": chat(url), "max_tokens": 1}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages.0.content.1.image_url.url" and reason in error["message"]
    assert httpx.get(f"{server}/health", timeout=10).json() == {"status": "ok"}


def test_placeholder_ids_without_images_get_a_400_not_a_500(server):
    """The QA pass of 2026-12-07: the API process checked placeholders only for requests with images, so a prompt
    of placeholder ids reached the engine's process, which refused it: a 500 (a stream's "error" finish)."""
    placeholder = get_preset("k3-tiny-vl").vision.image_token_id
    for stream in (False, True):
        body = {"model": MODEL, "prompt": [placeholder] * 4 + [65], "max_tokens": 2, "stream": stream}
        r = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "prompt" and f"id {placeholder}" in error["message"], error
    assert httpx.get(f"{server}/health", timeout=10).json() == {"status": "ok"}
