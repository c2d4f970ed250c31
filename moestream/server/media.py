"""Images of chat requests: OpenAI `image_url` content parts -> PIL images, under vLLM's
rules for where media may come from.

- `data:image/...;base64,...` URLs are decoded in memory (Pillow opens them lazily: only the
  header is read here, the pixels on the tokenizer thread).
- `http(s)` URLs are refused unless their host is in `--allowed-media-domains`; then they are
  fetched with a timeout and a size cap, and redirects must stay within those hosts. Nothing
  is ever fetched by default.
- `file://` URLs are refused unless `--allowed-local-media-path` is set and the file lies
  under it (after resolving symbolic links).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

FETCH_TIMEOUT_S = 10.0


class MediaError(ValueError):
    """An image part that cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from.

    Attributes:
        allowed_media_domains: hosts whose http(s) image URLs the server may fetch (vLLM's
            `--allowed-media-domains`); empty = none.
        allowed_local_media_path: a directory whose files `file://` URLs may name (vLLM's
            `--allowed-local-media-path`); None = no local files.
        max_bytes: most bytes of one image (decoded data URL or fetched body).
    """

    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: str | None = None
    max_bytes: int = 20 << 20


def _open(data: bytes, where: str) -> Any:
    from PIL import Image

    try:
        return Image.open(io.BytesIO(data))  # lazy: reads the header only
    except Exception as e:  # UnidentifiedImageError, DecompressionBombError, ...
        raise MediaError(f"{where} is not an image Pillow can read: {' '.join(str(e).split())}") from None


class _SameHostsRedirect(urllib.request.HTTPRedirectHandler):
    def __init__(self, hosts: tuple[str, ...]) -> None:
        self.hosts = hosts

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        host = urllib.parse.urlsplit(newurl).hostname or ""
        if host not in self.hosts:
            raise MediaError(f"the image URL redirects to '{host}', which is not in --allowed-media-domains")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def load_image(url: str, policy: MediaPolicy, where: str) -> Any:
    """The PIL image (not yet decoded) an `image_url.url` names; `where` names the part in
    errors (e.g. "messages[0].content[1]").

    Raises:
        MediaError: a malformed data URL, data that is not an image, a remote host or local
            path the policy does not allow, an unsupported scheme, a fetch that fails, or
            more than `max_bytes`.
    """
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64") or not header[5:].startswith("image/"):
            raise MediaError(f"{where}: a data URL must look like 'data:image/png;base64,<data>'")
        if len(payload) * 3 // 4 > policy.max_bytes:
            raise MediaError(f"{where}: the image is over {policy.max_bytes} bytes")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise MediaError(f"{where}: the data URL's base64 payload is malformed") from None
        return _open(data, where)
    if scheme in ("http", "https"):
        host = urllib.parse.urlsplit(url).hostname or ""
        if host not in policy.allowed_media_domains:
            raise MediaError(f"{where}: this server does not fetch remote images ('{host}' is not allowed); send the "
                             "image inline as a data URL, or start the server with --allowed-media-domains " + (host or "HOST"))
        opener = urllib.request.build_opener(_SameHostsRedirect(policy.allowed_media_domains))
        try:
            with opener.open(url, timeout=FETCH_TIMEOUT_S) as resp:
                data = resp.read(policy.max_bytes + 1)
        except MediaError:
            raise
        except Exception as e:
            raise MediaError(f"{where}: fetching the image failed: {' '.join(str(e).split())}") from None
        if len(data) > policy.max_bytes:
            raise MediaError(f"{where}: the image is over {policy.max_bytes} bytes")
        return _open(data, where)
    if scheme == "file":
        root = policy.allowed_local_media_path
        if root is None:
            raise MediaError(f"{where}: local files are refused; start the server with --allowed-local-media-path "
                             "DIR to serve images from DIR")
        path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlsplit(url).path))
        base = os.path.realpath(root)
        if os.path.commonpath([path, base]) != base:
            raise MediaError(f"{where}: '{path}' is outside --allowed-local-media-path {base}")
        try:
            if os.path.getsize(path) > policy.max_bytes:
                raise MediaError(f"{where}: the image is over {policy.max_bytes} bytes")
            with open(path, "rb") as f:
                return _open(f.read(), where)
        except OSError as e:
            raise MediaError(f"{where}: cannot read '{path}': {e.strerror}") from None
    raise MediaError(f"{where}: unsupported image URL scheme '{scheme or url[:20]}'; use a data: URL "
                     "(data:image/png;base64,...)")
