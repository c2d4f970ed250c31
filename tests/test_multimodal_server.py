"""Image chat over HTTP: a base64 PNG gives the offline call's text (httpx and the openai
client); bad images, refused URLs and too many images are 400s naming the part, and the
engine serves on with nothing leaked; remote and local images only where allowed."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time
from collections.abc import Iterator

import pytest
from live_server import LiveServer
from PIL import Image
from test_multimodal import IMAGES
from tiny_checkpoint import make_tiny_checkpoint

from moestream import LLM, SamplingParams
from moestream.config import EngineConfig
from moestream.server.serving import ServerConfig

NAME = "tiny-vl"


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("vl")), "qwen3_5_moe_vl", seed=4)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("media")
    (d / "cat.png").write_bytes(png(IMAGES[1]))
    return str(d)


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    """A local HTTP server with /a.png (IMAGES[1]), /bad.png (not an image), /away (a redirect to
    localhost, another host name) and /slow (a byte every 0.3 s); yields its base URL."""
    body = {"/a.png": png(IMAGES[1]), "/bad.png": b"not an image"}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/away":
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/a.png")
                self.end_headers()
                return
            if self.path == "/slow":
                self.send_response(200)
                self.end_headers()
                for b in png(IMAGES[1])[:20]:
                    self.wfile.write(bytes([b]))
                    self.wfile.flush()
                    time.sleep(0.3)
                return
            data = body.get(self.path)
            self.send_response(200 if data else 404)
            self.end_headers()
            self.wfile.write(data or b"")

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.fixture(scope="module")
def vl_server(vl_dir: str, media_dir: str) -> Iterator[LiveServer]:
    server = LiveServer(
        EngineConfig(model=vl_dir, dtype="float32", max_model_len=256, limit_mm_per_prompt={"image": 2},
                     max_image_pixels=200 * 200),
        ServerConfig(served_model_names=(NAME,), allowed_media_domains=("127.0.0.1",),
                     allowed_local_media_path=media_dir),
    )
    yield server
    server.stop()


def chat(server: LiveServer, parts: list[dict], **kw: object):  # type: ignore[no-untyped-def]
    body = {"model": NAME, "messages": [{"role": "user", "content": parts}], "max_tokens": 8, "temperature": 0, **kw}
    return server.post("/v1/chat/completions", json=body)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def offline_text(vl_dir: str, text: str, images: list[Image.Image]) -> str:
    """The same chat rendered by the tokenizer's template, generated offline."""
    llm = LLM(vl_dir, dtype="float32", max_model_len=256)
    tok = llm.llm_engine.tokenizer
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    prompt = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}},
                       SamplingParams(temperature=0, max_tokens=8))[0]
    return out.outputs[0].text


def test_base64_png_chat_equals_offline(vl_server: LiveServer, vl_dir: str) -> None:
    import openai

    expected = offline_text(vl_dir, "What is this?", [IMAGES[0]])
    r = chat(vl_server, [image_part(data_url(IMAGES[0])), {"type": "text", "text": "What is this?"}])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == expected
    client = openai.OpenAI(base_url=vl_server.base_url + "/v1", api_key="none")
    resp = client.chat.completions.create(model=NAME, max_tokens=8, temperature=0, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}}, {"type": "text", "text": "What is this?"}]}])
    assert resp.choices[0].message.content == expected
    vl_server.wait_idle()


def test_allowed_remote_and_local_images(vl_server: LiveServer, vl_dir: str, image_host: str, media_dir: str) -> None:
    """An allowed host's URL and a file under --allowed-local-media-path give the text of the
    same image sent inline."""
    expected = offline_text(vl_dir, "Hi", [IMAGES[1]])
    for url in (image_host + "/a.png", f"file://{media_dir}/cat.png", data_url(IMAGES[1])):
        r = chat(vl_server, [image_part(url), {"type": "text", "text": "Hi"}])
        assert r.status_code == 200, (url, r.text)
        assert r.json()["choices"][0]["message"]["content"] == expected, url
    vl_server.wait_idle()


@pytest.mark.parametrize("parts, param, message", [
    ([image_part("data:image/png;base64,@@@")], "messages[0].content[0]", "base64 payload is malformed"),
    ([{"type": "text", "text": "x"}, image_part("data:image/png;base64," + base64.b64encode(b"text").decode())],
     "messages[0].content[1]", "messages[0].content[1] is not an image Pillow can read (PNG, JPEG"),
    ([image_part("data:text/plain;base64,aGk=")], "messages[0].content[0]", "data:image/png;base64"),
    ([image_part("https://example.com/cat.png")], "messages[0].content[0]", "--allowed-media-domains example.com"),
    ([image_part("http://127.0.0.1:1/none.png")], "messages[0].content[0]", "fetching the image failed"),
    ([image_part("file:///etc/passwd")], "messages[0].content[0]", "outside --allowed-local-media-path"),
    ([image_part("ftp://x/y.png")], "messages[0].content[0]", "unsupported image URL 'ftp://x/y.png'"),
    ([image_part(data_url(IMAGES[0]))] * 3, "messages[0].content[2]", "over the limit of 2 per prompt"),
    ([image_part(data_url(Image.new("RGB", (300, 300))))], "messages[0].content[0]", "over the limit of 40000"),
    ([{"type": "text", "text": "x"}, image_part(data_url(Image.new("RGB", (1, 201))))], "messages[0].content[1]",
     "aspect ratio is over 200"),
    ([image_part("DATA:IMAGE/PNG;BASE64,@@")], "messages[0].content[0]", "base64 payload is malformed"),
    ([image_part("file://otherhost/etc/passwd")], "messages[0].content[0]", "got host 'otherhost'"),
    ([image_part("cat.png")], "messages[0].content[0]", "unsupported image URL 'cat.png'"),
    ([image_part("data:image/png;base64," + base64.b64encode(png(IMAGES[0])[:120]).decode())],
     "messages[0].content[0]", "messages[0].content[0] cannot be decoded"),
])
def test_bad_images_are_400s(vl_server: LiveServer, parts: list[dict], param: str, message: str) -> None:
    r = chat(vl_server, parts)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["param"] == param, err
    vl_server.wait_idle()
    ok = chat(vl_server, [image_part(data_url(IMAGES[0])), {"type": "text", "text": "still fine?"}])
    assert ok.status_code == 200


def test_remote_fetch_errors(vl_server: LiveServer, image_host: str) -> None:
    """A body that is not an image, a 404 and a redirect to a host not allowed are 400s; a host
    trickling bytes is cut off at the fetch deadline (whole body, not per read)."""
    from moestream.server.media import MediaError, MediaPolicy, read_image_bytes

    for path, message in (("/bad.png", "not an image Pillow can read"), ("/missing.png", "fetching the image failed"),
                          ("/away", "messages[0].content[0]: the image URL redirects to 'localhost', which is not")):
        r = chat(vl_server, [image_part(image_host + path)])
        assert r.status_code == 400 and message in r.json()["error"]["message"], (path, r.text)
    vl_server.wait_idle()
    start = time.monotonic()
    with pytest.raises(MediaError, match="fetching the image took over 1 s"):
        read_image_bytes(image_host + "/slow", MediaPolicy(("127.0.0.1",), fetch_timeout_s=1.0), "image")
    assert time.monotonic() - start < 5  # the whole body takes 6 s to arrive


def test_text_model_refuses_images(live_server: LiveServer) -> None:
    r = live_server.post("/v1/chat/completions", headers={"Authorization": "Bearer test-key"}, json={
        "model": "tiny-qwen3-moe", "max_tokens": 2, "messages": [{"role": "user", "content": [
            image_part(data_url(IMAGES[0]))]}]})
    assert r.status_code == 400 and "takes no images" in r.json()["error"]["message"], r.text


def test_allowed_local_media_path_must_exist(tmp_path) -> None:
    with pytest.raises(ValueError, match="is not a directory"):
        ServerConfig(served_model_names=(NAME,), allowed_local_media_path=str(tmp_path / "missing"))
