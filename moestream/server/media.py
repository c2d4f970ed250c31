"""Images of chat requests: OpenAI `image_url` content parts -> PIL images, under vLLM's
rules for where media may come from.

- `data:image/...;base64,...` URLs are decoded in memory.
- `http(s)` URLs are refused unless their host is in `--allowed-media-domains`; then they are
  fetched with a deadline for the whole body and a size cap, and redirects must stay within
  those hosts. Nothing is ever fetched by default.
- `file://` URLs (no host, or localhost) are refused unless `--allowed-local-media-path` is
  set and the file lies under it (after resolving symbolic links).

`read_image_bytes` gets the bytes (blocking for remote URLs); `open_image` checks the header
(pixel count, aspect ratio) before decoding the pixels.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

# Default for the whole fetch of one remote image (connect, headers, body), in seconds.
FETCH_TIMEOUT_S = 10.0
_CHUNK = 1 << 16


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
        max_bytes: most bytes of one image (decoded data URL, fetched body or file).
        fetch_timeout_s: the whole fetch of a remote image must end within this (seconds).
    """

    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: str | None = None
    max_bytes: int = 20 << 20
    fetch_timeout_s: float = FETCH_TIMEOUT_S


def url_scheme(url: str) -> str:
    """The URL's scheme, lower case ("" when it has none)."""
    scheme = url.split(":", 1)[0]
    return scheme.lower() if ":" in url and scheme.isascii() and scheme.isalpha() else ""


class _SameHostsRedirect(urllib.request.HTTPRedirectHandler):
    def __init__(self, hosts: tuple[str, ...], where: str) -> None:
        self.hosts, self.where = hosts, where

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        host = urllib.parse.urlsplit(newurl).hostname or ""
        if host not in self.hosts:
            raise MediaError(f"{self.where}: the image URL redirects to '{host}', which is not in "
                             "--allowed-media-domains")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(url: str, policy: MediaPolicy, where: str) -> bytes:
    deadline = time.monotonic() + policy.fetch_timeout_s
    opener = urllib.request.build_opener(_SameHostsRedirect(policy.allowed_media_domains, where))
    try:
        with opener.open(url, timeout=policy.fetch_timeout_s) as resp:
            chunks, size = [], 0
            while chunk := resp.read1(_CHUNK):  # what has arrived, so the deadline is checked as bytes trickle
                chunks.append(chunk)
                size += len(chunk)
                if size > policy.max_bytes:
                    raise MediaError(f"{where}: the image is over {policy.max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise MediaError(f"{where}: fetching the image took over {policy.fetch_timeout_s:g} s")
    except MediaError:
        raise
    except Exception as e:
        raise MediaError(f"{where}: fetching the image failed: {' '.join(str(e).split())}") from None
    return b"".join(chunks)


def read_image_bytes(url: str, policy: MediaPolicy, where: str) -> bytes:
    """The bytes an `image_url.url` names; `where` names the part in errors (e.g.
    "messages[0].content[1]"). Blocking: a remote URL is fetched here.

    Raises:
        MediaError: a malformed data URL, a remote host or local path the policy does not
            allow, an unsupported scheme, a fetch that fails or takes over `fetch_timeout_s`,
            or more than `max_bytes`.
    """
    scheme = url_scheme(url)
    if scheme == "data":
        header, sep, payload = url.partition(",")
        header = header.lower()
        if not sep or not header.endswith(";base64") or not header[5:].startswith("image/"):
            raise MediaError(f"{where}: a data URL must look like 'data:image/png;base64,<data>'")
        if len(payload) * 3 // 4 > policy.max_bytes:
            raise MediaError(f"{where}: the image is over {policy.max_bytes} bytes")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise MediaError(f"{where}: the data URL's base64 payload is malformed (standard base64 on one line, "
                             "as `base64 -w0` writes it)") from None
    if scheme in ("http", "https"):
        host = urllib.parse.urlsplit(url).hostname or ""
        if host not in policy.allowed_media_domains:
            raise MediaError(f"{where}: this server does not fetch remote images ('{host}' is not allowed); send the "
                             "image inline as a data URL, or start the server with --allowed-media-domains " + (host or "HOST"))
        return _fetch(url, policy, where)
    if scheme == "file":
        root = policy.allowed_local_media_path
        if root is None:
            raise MediaError(f"{where}: local files are refused; start the server with --allowed-local-media-path "
                             "DIR to serve images from DIR")
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise MediaError(f"{where}: a file URL names a file of this machine (file:///path); got host '{parts.netloc}'")
        path = os.path.realpath(urllib.parse.unquote(parts.path))
        base = os.path.realpath(root)
        if os.path.commonpath([path, base]) != base:
            raise MediaError(f"{where}: '{path}' is outside --allowed-local-media-path {base}")
        try:
            if os.path.getsize(path) > policy.max_bytes:
                raise MediaError(f"{where}: the image is over {policy.max_bytes} bytes")
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise MediaError(f"{where}: cannot read '{path}': {e.strerror}") from None
    shown = url if len(url) <= 40 else url[:37] + "..."
    raise MediaError(f"{where}: unsupported image URL {shown!r}; use a data: URL (data:image/png;base64,...)"
                     + (" or http(s) from --allowed-media-domains" if policy.allowed_media_domains else ""))


def open_image(data: bytes, where: str) -> Any:
    """A PIL image of `data`, header read only (pixels decoded by the caller after its checks).

    Raises:
        MediaError: `data` is not an image Pillow can read (or claims a decompression bomb's size).
    """
    from PIL import Image

    try:
        return Image.open(io.BytesIO(data))
    except Image.UnidentifiedImageError:
        raise MediaError(f"{where} is not an image Pillow can read (PNG, JPEG, GIF, BMP, WEBP, TIFF, ...)") from None
    except Exception as e:  # DecompressionBombError, ...
        raise MediaError(f"{where} is not an image Pillow can read: {' '.join(str(e).split())}") from None
