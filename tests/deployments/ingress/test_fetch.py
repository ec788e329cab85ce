"""Fetching a first frame over http(s): only from the operator's allow-list, by a plain path, no redirects,
bounded in size and in time overall. A real HTTP server on localhost serves the images."""
import socket
import threading
import time
from http.server import ThreadingHTTPServer

import pytest

from deployments.ingress.fetch import ImageFetcher
from deployments.ingress.parsing import decode_image
from deployments.session.codes import ProtocolError
from deployments.settings import ServeSettings, parse_allowlist
from lingbot.config import ConfigError
from tests.deployments.ingress.image_server import Images


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Images)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def refused(fn, match):
    with pytest.raises(ProtocolError, match=match) as e:
        fn()
    assert e.value.code == "invalid_image"


def test_allowlist_entries_are_whole_prefixes():
    assert parse_allowlist(" https://cdn.example.com/img/ , http://10.0.0.5:8080/") == \
        ("https://cdn.example.com/img/", "http://10.0.0.5:8080/")
    for bad in ("https://cdn.example.com", "ftp://x/", "https://user:pw@cdn.example.com/", "https://x/?a=1/", "/x/"):
        with pytest.raises(ValueError, match="must be scheme://host"):
            parse_allowlist(bad)
    with pytest.raises(ConfigError, match="image_url_allowlist entry"):
        ServeSettings(image_url_allowlist="https://cdn.example.com")
    assert ImageFetcher.from_settings("", 1.0, 10) is None
    fetcher = ImageFetcher(("https://cdn.example.com/img/",))
    assert fetcher.allowed("https://cdn.example.com/img/a.png")
    assert not fetcher.allowed("https://cdn.example.com.evil.org/img/a.png")
    assert not fetcher.allowed("https://cdn.example.com/other/a.png")
    assert not fetcher.allowed("https://x@cdn.example.com/img/a.png")


def test_fetch_from_the_allowlist_only(server):
    fetcher = ImageFetcher((f"{server}/ok/",), timeout_s=5.0, max_bytes=4096)
    image = decode_image(f"{server}/ok/a.png", 112, 64, fetcher)
    assert image.shape == (3, 64, 112) and abs(float(image.mean()) - (200 / 127.5 - 1)) < 1e-6
    refused(lambda: decode_image(f"{server}/private/a.png", 112, 64, fetcher), "allow-list")
    refused(lambda: decode_image(f"{server}/ok/a.png", 112, 64), "not fetched")          # no allow-list: never
    refused(lambda: decode_image(f"{server}/ok/moved.png", 112, 64, fetcher), "redirects are not followed")
    refused(lambda: decode_image(f"{server}/ok/big.png", 112, 64, fetcher), "more than 4096 bytes")
    refused(lambda: decode_image(f"{server}/ok/missing.png", 112, 64, fetcher), "HTTP 404")
    closed = ImageFetcher(("http://127.0.0.1:9/",), timeout_s=2.0)
    refused(lambda: decode_image("http://127.0.0.1:9/a.png", 112, 64, closed), "could not be fetched")


def test_paths_that_could_leave_the_prefix_are_refused(server):
    """Dot-segments, plain or percent-encoded (once or twice), and encoded or backslash separators: a server
    that resolves them would serve what lies outside the allowed prefix. Refused before any request."""
    fetcher = ImageFetcher((f"{server}/ok/",), timeout_s=5.0)
    for path in ("../private/a.png", "%2e%2e/private/a.png", "%2E%2e/private/a.png", ".%2e/private/a.png",
                 "%252e%252e/private/a.png", "..%2fprivate/a.png", "..%5cprivate", "..\\private/a.png",
                 "./a.png", "sub/../../private/a.png", "a%2fb.png"):
        assert not fetcher.allowed(f"{server}/ok/{path}"), path
        refused(lambda p=path: fetcher.fetch(f"{server}/ok/{p}"), "allow-list")
    for path in ("a.png", "a..png", "..a.png", "sub/.hidden.png", "a%20b.png"):      # dots inside a name are fine
        assert fetcher.allowed(f"{server}/ok/{path}"), path


def test_the_fetch_has_one_overall_deadline(server):
    """A host that answers a byte at a time (every read within the socket timeout), or accepts and never
    answers, is cut at the fetch's deadline, not after its whole body."""
    fetcher = ImageFetcher((f"{server}/ok/",), timeout_s=1.0)
    t0 = time.monotonic()
    refused(lambda: fetcher.fetch(f"{server}/ok/slow.png"), "took longer than 1 s")
    assert time.monotonic() - t0 < 1.8
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)                                    # accepts (the kernel does), never answers
    try:
        port = silent.getsockname()[1]
        mute = ImageFetcher((f"http://127.0.0.1:{port}/",), timeout_s=1.0)
        t0 = time.monotonic()
        refused(lambda: mute.fetch(f"http://127.0.0.1:{port}/a.png"), "took longer than 1 s")
        assert time.monotonic() - t0 < 1.8
    finally:
        silent.close()
