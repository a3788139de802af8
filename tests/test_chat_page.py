"""The chat page `openk3 serve` shows at /, driven in headless Chromium (Debian's `chromium`, through Playwright's
Python package; no browser download) against real server processes: two typed turns stream their replies, the
second turn's stats line shows the prefix cache serving the first turn, and each reply is the text the API gives
for the same conversation (so the page resends it whole, assembles the stream right and escapes the text); a
refused turn shows the server's error, is left out of the conversation and goes back to the composer; "New chat"
starts over. Stop aborts the stream (the server cancels the request) and a double click on Send does not stop; a
broken stream or an unreachable server is said so; model text is escaped, wraps at 375 px and reads right to left
where it is Hebrew; a field that is not a number is refused before sending. On a vision model the page attaches an
image as a data: URL part and refuses a file that is not an image. Screenshots go to the test's tmp_path.

Needs `apt-get install chromium` and the test extras (playwright). In CI (CI=true) a missing browser fails the test;
elsewhere it is skipped with the install command."""

import base64
import io
import json
import os
import re
import shutil
import time

import httpx
import pytest
import torch
from PIL import Image

from serve_process import metric, o1_checkpoint, serve_process

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WAIT_MS = 120_000  # a reply on a busy 2-core machine; typically well under a second
H = 16  # the prefix cache's hash block for k3-tiny's context
STATS = re.compile(r"TTFT (\d+) ms · (–|[\d.]+) tokens/s · (\d+) tokens · cached (\d+) of (\d+) prompt tokens"
                   r"( · finish: length)?")


def browser_or_skip():
    """Playwright's sync API, or a skip naming the install (a failure under CI, which must run this test)."""
    missing = []
    if shutil.which(CHROMIUM) is None:
        missing.append("apt-get update && apt-get install -y chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing.append('pip install -e ".[test]"  # playwright')
    if missing:
        message = "the chat page test needs a headless Chromium: " + "; ".join(missing)
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return sync_playwright


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """One Chromium with a fresh profile per module (a persistent context: Playwright's way to set the profile)."""
    sync_playwright = browser_or_skip()
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            tmp_path_factory.mktemp("chromium-profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield context
        context.close()


@pytest.fixture
def page(browser):
    """A new tab that fails the test on any uncaught script error."""
    tab, errors = browser.new_page(), []
    tab.on("pageerror", lambda error: errors.append(error))
    yield tab
    tab.close()
    assert not errors, f"the page raised: {errors}"


def open_chat(page, url: str, model: str) -> None:
    from playwright.sync_api import expect

    page.goto(f"{url}/")
    expect(page.locator("#model")).to_have_text(model)
    expect(page.locator("#send")).to_be_enabled()
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "8")


def send(page, text: str, turn: int) -> tuple[str, str]:
    """Type `text`, press Enter, wait for reply number `turn` (from 1) to finish; returns its text and stats line."""
    from playwright.sync_api import expect

    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    expect(page.locator(".message.assistant:not(.pending)")).to_have_count(turn, timeout=WAIT_MS)
    reply = page.locator(".message.assistant").nth(turn - 1)
    return reply.locator(".text").text_content(), reply.locator(".stats").text_content()


def send_and_wait(page, text: str, turn: int) -> tuple[str, re.Match]:
    """`send`, checking that the reply came (its stats line parsed)."""
    reply, stats = send(page, text, turn)
    match = STATS.fullmatch(stats)
    assert match, f"unexpected stats line {stats!r}"
    return reply, match


def api_reply(url: str, model: str, messages: list) -> dict:
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 8}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_page_is_one_self_contained_file(o1_server):
    r = httpx.get(f"{o1_server}/", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in r.headers["content-security-policy"]
    assert re.search(r"https?://|=\s*[\"']//", r.text) is None, "the page must not load anything from elsewhere"
    assert "innerHTML" not in r.text and "insertAdjacentHTML" not in r.text
    model = httpx.get(f"{o1_server}/v1/models", timeout=10).json()["data"][0]
    assert model["input_modalities"] == ["text"]


def test_two_turns_stream_and_the_second_hits_the_prefix_cache(o1_server, page, tmp_path):
    open_chat(page, o1_server, "k3-tiny")
    assert page.locator("#attach-button").is_hidden()  # a text model takes no images
    first = "Tell me about <b>hybrid</b> attention & the KDA state, briefly."
    reply1, stats1 = send_and_wait(page, first, 1)
    assert page.locator(".message.user .text").first.text_content() == first  # shown as text, not markup
    assert page.locator("#log b").count() == 0
    second = "And the prefix cache?"
    reply2, stats2 = send_and_wait(page, second, 2)
    page.screenshot(path=tmp_path / "chat.png", full_page=True)

    messages = [{"role": "user", "content": first}]
    expected1 = api_reply(o1_server, "k3-tiny", messages)
    messages += [{"role": "assistant", "content": reply1}, {"role": "user", "content": second}]
    expected2 = api_reply(o1_server, "k3-tiny", messages)
    assert reply1 == expected1["choices"][0]["message"]["content"]
    assert reply2 == expected2["choices"][0]["message"]["content"]
    prompt1, prompt2 = int(stats1[5]), int(stats2[5])
    assert (prompt1, prompt2) == (expected1["usage"]["prompt_tokens"], expected2["usage"]["prompt_tokens"])
    assert int(stats1[3]) == expected1["usage"]["completion_tokens"]
    assert int(stats1[4]) == 0  # a fresh server: nothing to reuse yet
    assert int(stats2[4]) >= H * ((prompt1 - 1) // H) > 0  # the first turn's prompt, served from the cache
    assert int(stats2[1]) > 0


def test_a_refused_turn_is_not_resent_and_new_chat_starts_over(o1_server, page):
    open_chat(page, o1_server, "k3-tiny")
    page.fill("#max-tokens", "0")
    _, stats = send(page, "This turn asks for no tokens.", 1)
    assert stats.startswith("error: max_tokens must be in [1, ") and stats.endswith("(this turn is not resent)")
    assert page.input_value("#prompt") == "This turn asks for no tokens."  # back in the composer, to edit
    page.fill("#max-tokens", "8")
    long = "word " * 5000  # over the context: 413
    assert send(page, long, 2)[1].startswith("error: the prompt has at least ")
    assert page.input_value("#prompt") == long.strip()
    alone = api_reply(o1_server, "k3-tiny", [{"role": "user", "content": "Hello"}])["usage"]["prompt_tokens"]
    assert int(send_and_wait(page, "Hello", 3)[1][5]) == alone
    page.click("#new-chat")
    assert page.locator(".message").count() == 0 and page.locator("#empty").is_visible()
    assert int(send_and_wait(page, "Hello", 1)[1][5]) == alone


def test_stop_cancels_the_reply_and_a_double_click_sends_once(o1_server, page):
    from playwright.sync_api import expect

    open_chat(page, o1_server, "k3-tiny")

    def long_reply(route):  # a reply that runs until stopped
        body = {**json.loads(route.request.post_data), "ignore_eos": True, "max_tokens": 4000}
        route.continue_(post_data=json.dumps(body))

    page.route("**/v1/chat/completions", long_reply)
    cancelled = metric(o1_server, 'requests_finished_total{reason="cancelled"}')
    page.fill("#prompt", "Go on and on.")
    page.dblclick("#send")  # one send: the second click does not stop it
    reply = page.locator(".message.assistant")
    expect(reply.locator(".text")).not_to_have_text("", timeout=WAIT_MS)
    assert page.evaluate("document.activeElement.id") == "prompt"  # ready for the next message
    assert page.text_content("#send") == "Stop" and reply.get_attribute("aria-busy") == "true"
    page.click("#send")
    expect(reply.locator(".stats")).to_have_text("stopped")
    expect(page.locator("#send")).to_have_text("Send")
    partial = reply.locator(".text").text_content()
    deadline = time.monotonic() + 30
    while metric(o1_server, 'requests_finished_total{reason="cancelled"}') == cancelled:
        assert time.monotonic() < deadline, "the server did not cancel the stopped reply"
        time.sleep(0.05)

    page.unroute("**/v1/chat/completions")
    with page.expect_request("**/v1/chat/completions") as request:
        send_and_wait(page, "Thanks.", 2)
    assert request.value.post_data_json["messages"] == [  # the stopped reply stays in the conversation
        {"role": "user", "content": "Go on and on."}, {"role": "assistant", "content": partial},
        {"role": "user", "content": "Thanks."}]


def test_a_broken_stream_or_an_unreachable_server_is_said_so(o1_server, page):
    from playwright.sync_api import expect

    open_chat(page, o1_server, "k3-tiny")
    held = []
    page.route("**/v1/chat/completions", lambda route: held.append(route))  # never answered: stopped early
    page.fill("#prompt", "Never mind.")
    page.press("#prompt", "Enter")
    expect(page.locator("#send")).to_have_text("Stop")
    page.click("#send")
    expect(page.locator(".message.assistant .stats")).to_have_text(
        "stopped before the reply began (this turn is not resent)")
    page.unroute("**/v1/chat/completions")
    chunk = {"choices": [{"index": 0, "delta": {"content": "Half a rep"}, "finish_reason": None}]}
    page.route("**/v1/chat/completions", lambda route: route.fulfill(  # no "data: [DONE]": cut off
        status=200, headers={"Content-Type": "text/event-stream"}, body=f"data: {json.dumps(chunk)}\n\n"))
    assert send(page, "Cut me off.", 2) == (
        "Half a rep", "error: the server closed the stream before the reply was complete (this turn is not resent)")
    assert page.input_value("#prompt") == "Cut me off."
    page.unroute("**/v1/chat/completions")
    page.route("**/v1/chat/completions", lambda route: route.abort("connectionrefused"))
    stats = send(page, "Anyone there?", 3)[1]
    assert stats.startswith("error: the server cannot be reached (") and stats.endswith("(this turn is not resent)")


def test_model_text_is_escaped_wraps_on_a_phone_and_reads_right_to_left(o1_server, page, tmp_path):
    page.set_viewport_size({"width": 375, "height": 700})
    open_chat(page, o1_server, "k3-tiny")
    pieces = ["<img src=x onerror=alert(1)>", "<script>alert(2)</script>\n\nline two ", "A" * 300,
              " https://example.com/" + "x" * 200]
    events = [{"choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]} for p in pieces]
    events.append({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4,
                                            "prompt_tokens_details": {"cached_tokens": 0}}})
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=body))
    hebrew = "שלום, מה שלומך? " + "B" * 200
    reply, stats = send(page, hebrew, 1)
    page.screenshot(path=tmp_path / "chat-375.png")
    assert reply == "".join(pieces) and page.locator("#log img, #log script").count() == 0
    assert STATS.fullmatch(stats)
    widths = page.evaluate("[document.documentElement, document.getElementById('log')]"
                           ".map((e) => e.scrollWidth - e.clientWidth)")
    assert widths == [0, 0], "no horizontal overflow"
    direction = "(e) => getComputedStyle(e).direction"
    assert page.locator(".message.user .text").evaluate(direction) == "rtl"
    assert page.locator(".message.assistant .text").evaluate(direction) == "ltr"
    assert page.locator(".message.assistant .stats").evaluate(  # scrolled into view once the reply is complete
        "(e) => e.getBoundingClientRect().bottom <= document.getElementById('log').getBoundingClientRect().bottom")

    page.fill("#max-tokens", "")
    page.type("#max-tokens", "1e")  # not a number: refused here, not sent as the server's default
    page.fill("#prompt", "Again.")
    page.press("#prompt", "Enter")
    assert page.text_content("#notice") == "max_tokens is not a number" and page.is_visible("#notice")
    assert page.locator(".message").count() == 2 and page.input_value("#prompt") == "Again."


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory):
    with serve_process("--ckpt", o1_checkpoint(tmp_path_factory.mktemp("o1-k3-tiny-vl"), preset="k3-tiny-vl"),
                       "--model-name", "k3-tiny-vl") as (url, _):
        yield url


def test_an_image_goes_with_the_turn_on_a_vision_model(vl_server, page, tmp_path):
    gen = torch.Generator().manual_seed(3)
    pixels = torch.randint(0, 256, (84, 112, 3), generator=gen, dtype=torch.uint8).numpy()  # (3 x 4) image tokens
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    (tmp_path / "picture.png").write_bytes(buffer.getvalue())

    open_chat(page, vl_server, "k3-tiny-vl")
    assert page.locator("#vision-badge").is_visible() and page.locator("#attach-button").is_visible()
    (tmp_path / "notes.txt").write_text("not an image")
    page.set_input_files("#image", tmp_path / "notes.txt")
    assert page.text_content("#notice") == "notes.txt is not a PNG, JPEG or WebP image"
    assert page.locator("#attachment").is_hidden()
    page.set_input_files("#image", tmp_path / "picture.png")
    page.locator("#attachment").wait_for(state="visible")
    assert page.locator("#notice").is_hidden()
    reply, stats = send_and_wait(page, "Describe the picture.", 1)
    page.screenshot(path=tmp_path / "chat-vl.png", full_page=True)

    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe the picture."}]
    expected = api_reply(vl_server, "k3-tiny-vl", [{"role": "user", "content": content}])
    assert reply == expected["choices"][0]["message"]["content"]
    assert int(stats[5]) == expected["usage"]["prompt_tokens"]
    assert page.locator(".message.user img").count() == 1 and page.locator("#attachment").is_hidden()
