"""Fetching a first frame from an http(s) URL, only where the operator allows it (`image_url_allowlist`,
parsed and checked with the settings: deployments.settings.parse_allowlist).

Off by default: a server that fetches whatever URL a client names can be made to probe its own network.
With an allow-list, a URL is fetched only when it starts with one of the listed prefixes (each a full
`scheme://host[:port]/path/`, ending in "/", so that a prefix never matches another host), without
credentials in it, without dot-segments or encoded separators in its path (`..`, `%2e%2e`, `%2f`: a
server that resolves them would serve what lies outside the prefix), without following redirects, within
a size limit and one overall deadline (connect, headers and body together: a host that answers one byte at
a time cannot hold the thread that fetches). Every refusal is a ProtocolError with code `invalid_image`
and says why. Plain Python (no Ray).
"""
from __future__ import annotations

import http.client
import ssl
import time
from dataclasses import dataclass
from typing import Optional
from urllib.parse import unquote, urlsplit

from ..session.codes import ErrorCode, ProtocolError
from ..settings import parse_allowlist


@dataclass(frozen=True)
class ImageFetcher:
    prefixes: tuple[str, ...]
    timeout_s: float = 10.0
    max_bytes: int = 20 * 2 ** 20

    @classmethod
    def from_settings(cls, allowlist: str, timeout_s: float, max_bytes: int) -> Optional[ImageFetcher]:
        prefixes = parse_allowlist(allowlist)
        return cls(prefixes, timeout_s, max_bytes) if prefixes else None

    def allowed(self, url: str) -> bool:
        parts = urlsplit(url)
        return parts.scheme in ("http", "https") and "@" not in parts.netloc and \
            any(url.startswith(p) for p in self.prefixes) and not _escapes(parts.path)

    def fetch(self, url: str) -> bytes:
        if not self.allowed(url):
            raise ProtocolError(ErrorCode.INVALID_IMAGE, "this server fetches images only from its allow-list "
                                "(image_url_allowlist), by a plain path; send the image inline")
        deadline = time.monotonic() + self.timeout_s
        try:
            return self._fetch(url, deadline)
        except ProtocolError:
            raise
        except TimeoutError:
            raise self._too_slow() from None
        except (OSError, http.client.HTTPException, ValueError) as e:   # resets, refusals, bad answers
            raise ProtocolError(ErrorCode.INVALID_IMAGE,
                                f"image_url could not be fetched ({type(e).__name__})") from None

    def _fetch(self, url: str, deadline: float) -> bytes:
        parts = urlsplit(url)
        connection = (http.client.HTTPSConnection(parts.hostname, parts.port, timeout=self._left(deadline),
                                                  context=ssl.create_default_context())
                      if parts.scheme == "https" else
                      http.client.HTTPConnection(parts.hostname, parts.port, timeout=self._left(deadline)))
        try:
            target = parts.path + (f"?{parts.query}" if parts.query else "")
            connection.request("GET", target, headers={"User-Agent": "lingbot-serve", "Accept-Encoding": "identity"})
            sock = connection.sock                      # the connection lets go of it once the body is read
            sock.settimeout(self._left(deadline))
            response = connection.getresponse()
            if 300 <= response.status < 400:
                raise ProtocolError(ErrorCode.INVALID_IMAGE, f"image_url redirects (HTTP {response.status}); "
                                    "redirects are not followed")
            if response.status != 200:
                raise ProtocolError(ErrorCode.INVALID_IMAGE, f"image_url answered HTTP {response.status}")
            data = bytearray()
            while len(data) <= self.max_bytes and not response.isclosed():
                sock.settimeout(self._left(deadline))
                piece = response.read1(min(2 ** 16, self.max_bytes + 1 - len(data)))
                if not piece:
                    break
                data += piece
            if len(data) > self.max_bytes:
                raise ProtocolError(ErrorCode.INVALID_IMAGE, f"image_url holds more than {self.max_bytes} bytes")
            return bytes(data)
        finally:
            connection.close()

    def _left(self, deadline: float) -> float:
        """Seconds left before the fetch's deadline; past it, the fetch is refused."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise self._too_slow()
        return left

    def _too_slow(self) -> ProtocolError:
        return ProtocolError(ErrorCode.INVALID_IMAGE, f"image_url took longer than {self.timeout_s:g} s")


def _escapes(path: str) -> bool:
    """Whether a URL path could leave its prefix on a server that resolves it: a `.` or `..` segment, plain or
    percent-encoded (once or more), or an encoded or backslash separator."""
    decoded = path
    for _ in range(3):                                   # %252e%252e: encoded twice
        decoded = unquote(decoded)
    lowered = path.lower()
    return "\\" in decoded or "%2f" in lowered or "%5c" in lowered or "%25" in lowered or \
        any(segment in (".", "..") for segment in decoded.split("/"))
