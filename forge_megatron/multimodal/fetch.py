"""Image URLs an agent sends, fetched by the gateway under an explicit policy (off by default).

Black-box agents often pass images by URL (``image_url: {url: "https://..."}``, Anthropic's ``source: {type: url}``,
the Responses API's ``input_image``) or, on the agent's own host, as files (a GUI agent's screenshots). The gateway
takes them only when started with ``--image-url-hosts`` (host globs) or ``--image-dir`` (a directory); every other
URL is refused with a 400 that says how to send the image inline. What a fetch returns goes through the same checks
and normalisation as an inline image (multimodal/images.py), and the trajectory records the normalised bytes, so
training never fetches anything.

Guards, because an agent chooses the URL and the gateway runs next to the training cluster:

- http(s) only to hosts matching a glob of ``--image-url-hosts`` (``*`` for any), and only to public addresses: a
  host resolving to a private, loopback, link-local, multicast or reserved address is refused unless
  ``--image-url-private`` (the cluster's own image store, a test server). The connection goes to the address that
  was checked (no second lookup a DNS rebinding could change), TLS verified against the host name.
- at most ``MAX_REDIRECTS`` redirects, each target checked the same way; a 200 with an ``image/*`` content type
  only; at most :data:`~forge_megatron.multimodal.images.MAX_IMAGE_BYTES` (a declared length over it is refused
  before reading, a body over it while reading); one deadline for the whole fetch (``--image-url-timeout-s``).
- ``file://`` URLs (no host, or localhost) only for files under ``--image-dir`` once symbolic links are resolved.
"""

from __future__ import annotations

import fnmatch
import http.client
import ipaddress
import os
import socket
import ssl
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass

from forge_megatron.multimodal.images import MAX_IMAGE_BYTES, ImageError

MAX_REDIRECTS = 3


@dataclass(frozen=True)
class ImageURL:
    """An image part given by URL (http, https or file), to be fetched under the gateway's :class:`UrlPolicy`;
    ``where`` names the part for errors."""

    url: str
    where: str


@dataclass(frozen=True)
class UrlPolicy:
    """Which image URLs a gateway fetches (module docstring). The default fetches none."""

    hosts: tuple[str, ...] = ()  # host globs whose http(s) URLs are fetched (lower case; "*": any host)
    private: bool = False  # also hosts resolving to private, loopback or link-local addresses
    directory: str | None = None  # file:// URLs of files under this directory
    timeout_s: float = 10.0  # the whole fetch, redirects included

    def __post_init__(self):
        object.__setattr__(self, "hosts", tuple(h.strip().lower() for h in self.hosts if h.strip()))
        if self.directory is not None and not os.path.isdir(self.directory):
            raise ValueError(f"image directory {self.directory!r} is not a directory")
        if self.timeout_s <= 0:
            raise ValueError(f"image URL timeout must be > 0 seconds, got {self.timeout_s}")

    @property
    def enabled(self) -> bool:
        return bool(self.hosts or self.directory)


def fetch_image(image: ImageURL, policy: UrlPolicy) -> bytes:
    """The bytes behind ``image.url`` under ``policy``; ImageError naming the part and the reason otherwise."""
    url, where = image.url, image.where
    if not policy.enabled:
        raise ImageError(f"{where}: this gateway fetches no image URLs (it was started without --image-url-hosts "
                         "or --image-dir): send the image inline, as a data:image/...;base64 URL", where)
    if url.startswith("file:"):
        return _read_file(url, policy, where)
    deadline = time.monotonic() + policy.timeout_s
    for _ in range(MAX_REDIRECTS + 1):
        data, url = _get(url, policy, where, deadline)
        if data is not None:
            return data
    raise ImageError(f"{where}: more than {MAX_REDIRECTS} redirects", where)


def _read_file(url: str, policy: UrlPolicy, where: str) -> bytes:
    parts = urllib.parse.urlsplit(url)
    if policy.directory is None:
        raise ImageError(f"{where}: this gateway reads no image files (start it with --image-dir DIR)", where)
    if parts.netloc not in ("", "localhost"):
        raise ImageError(f"{where}: a file URL must name a file on the gateway's host (file:///path), got host "
                         f"{parts.netloc!r}", where)
    path = os.path.realpath(urllib.request.url2pathname(parts.path))
    root = os.path.realpath(policy.directory)
    if os.path.commonpath([path, root]) != root:
        raise ImageError(f"{where}: {parts.path!r} is not under the gateway's --image-dir", where)
    try:
        if os.path.getsize(path) > MAX_IMAGE_BYTES:
            raise ImageError(f"{where}: {parts.path!r} is over {MAX_IMAGE_BYTES >> 20} MiB", where)
        with open(path, "rb") as f:
            return f.read(MAX_IMAGE_BYTES + 1)
    except OSError as exc:
        raise ImageError(f"{where}: cannot read {parts.path!r}: {exc.strerror or exc}", where) from None


def _checked_address(host: str, port: int, policy: UrlPolicy, where: str) -> str:
    """The address to connect to: ``host`` must match a glob of the policy, and every address it resolves to
    must be public (or the policy takes private ones)."""
    if not any(fnmatch.fnmatchcase(host.lower(), glob) for glob in policy.hosts):
        raise ImageError(f"{where}: host {host!r} is not among the gateway's --image-url-hosts", where)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ImageError(f"{where}: cannot resolve {host!r}: {exc}", where) from None
    addresses = [info[4][0] for info in infos]
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%")[0])
        if not policy.private and not ip.is_global:
            raise ImageError(f"{where}: {host!r} resolves to {address}, a private, loopback, link-local or reserved "
                             "address (the gateway fetches those only with --image-url-private)", where)
    return addresses[0]


def _get(url: str, policy: UrlPolicy, where: str, deadline: float) -> tuple[bytes | None, str]:
    """One GET: (the image's bytes, url), or (None, the redirect's target)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ImageError(f"{where}: an image URL must be http(s)://host/... or file:///path, got {url[:100]!r}",
                         where)
    tls = parts.scheme == "https"
    try:
        port = parts.port or (443 if tls else 80)
    except ValueError:
        raise ImageError(f"{where}: bad port in {url[:100]!r}", where) from None
    address = _checked_address(parts.hostname, port, policy, where)

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ImageError(f"{where}: fetching {url[:100]!r} took over {policy.timeout_s:g} s", where)
        return remaining

    conn = http.client.HTTPConnection(parts.hostname, port, timeout=left())
    try:
        sock = socket.create_connection((address, port), timeout=left())
        if tls:
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=parts.hostname)
        conn.sock = sock  # http.client sends over it as it is: the address checked above
        path = parts.path or "/"
        conn.request("GET", path + (f"?{parts.query}" if parts.query else ""),
                     headers={"Host": parts.netloc.rsplit("@", 1)[-1], "Accept": "image/*",
                              "User-Agent": "forge-gateway"})
        resp = conn.getresponse()
        if resp.status in (301, 302, 303, 307, 308):
            target = resp.getheader("Location")
            if not target:
                raise ImageError(f"{where}: {url[:100]!r} redirects nowhere (no Location)", where)
            return None, urllib.parse.urljoin(url, target)
        if resp.status != 200:
            raise ImageError(f"{where}: {url[:100]!r} answered HTTP {resp.status} {resp.reason}", where)
        kind = (resp.getheader("Content-Type") or "").split(";")[0].strip().lower()
        if not kind.startswith("image/"):
            raise ImageError(f"{where}: {url[:100]!r} is {kind or 'of no content type'}, not an image", where)
        declared = resp.getheader("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_IMAGE_BYTES:
            raise ImageError(f"{where}: {url[:100]!r} is over {MAX_IMAGE_BYTES >> 20} MiB", where)
        chunks, size = [], 0
        while True:  # (each read waits at most the time left when the socket was made; the deadline is checked too)
            left()
            chunk = resp.read(1 << 16)
            if not chunk:
                break
            size += len(chunk)
            if size > MAX_IMAGE_BYTES:
                raise ImageError(f"{where}: {url[:100]!r} is over {MAX_IMAGE_BYTES >> 20} MiB", where)
            chunks.append(chunk)
        return b"".join(chunks), url
    except ImageError:
        raise
    except (OSError, http.client.HTTPException) as exc:  # timeouts, refused connections, TLS, broken responses
        if isinstance(exc, TimeoutError):
            raise ImageError(f"{where}: fetching {url[:100]!r} took over {policy.timeout_s:g} s", where) from None
        raise ImageError(f"{where}: cannot fetch {url[:100]!r}: {exc or type(exc).__name__}", where) from None
    finally:
        conn.close()
