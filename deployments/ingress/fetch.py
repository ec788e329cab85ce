"""Fetching a first frame from an http(s) URL, only where the operator allows it (`image_url_allowlist`,
parsed and checked with the settings: deployments.settings.parse_allowlist).

Off by default: a server that fetches whatever URL a client names can be made to probe its own network.
With an allow-list, a URL is fetched only when it starts with one of the listed prefixes (each a full
`scheme://host[:port]/path/`, ending in "/", so that a prefix never matches another host), without
credentials in it, without following redirects, within a time and a size limit. Every refusal is a
ProtocolError with code `invalid_image` and says why. Plain Python (no Ray).
"""
from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Optional
from urllib.parse import urlsplit

from ..session.codes import ErrorCode, ProtocolError
from ..settings import parse_allowlist


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise ProtocolError(ErrorCode.INVALID_IMAGE, f"image_url redirects (HTTP {code}); redirects are not followed")


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
            any(url.startswith(p) for p in self.prefixes)

    def fetch(self, url: str) -> bytes:
        if not self.allowed(url):
            raise ProtocolError(ErrorCode.INVALID_IMAGE, "this server fetches images only from its allow-list "
                                "(image_url_allowlist); send the image inline")
        opener = urllib.request.build_opener(_NoRedirect)
        try:
            with opener.open(urllib.request.Request(url, headers={"User-Agent": "lingbot-serve"}),
                             timeout=self.timeout_s) as response:
                data = response.read(self.max_bytes + 1)
        except ProtocolError:
            raise
        except urllib.error.HTTPError as e:
            raise ProtocolError(ErrorCode.INVALID_IMAGE, f"image_url answered HTTP {e.code}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            raise ProtocolError(ErrorCode.INVALID_IMAGE,
                                f"image_url could not be fetched ({type(reason).__name__})") from None
        if len(data) > self.max_bytes:
            raise ProtocolError(ErrorCode.INVALID_IMAGE, f"image_url holds more than {self.max_bytes} bytes")
        return data
