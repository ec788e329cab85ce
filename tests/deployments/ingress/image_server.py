"""An HTTP server of images for the ingress's fetcher (deployments/ingress/fetch.py): a good one, one too large,
one that trickles, a redirect and a 404, under /ok/ and elsewhere; serve it with ThreadingHTTPServer."""
import io
import time
from http.server import BaseHTTPRequestHandler

import numpy as np
from PIL import Image


def png(w=40, h=30) -> bytes:
    """The PNG it serves at /ok/a.png (a grey 40x30)."""
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), 200, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


class Images(BaseHTTPRequestHandler):
    """/ok/a.png, /ok/big.png (too large), /ok/slow.png (one byte every 0.2 s), /ok/moved.png (a redirect out of
    /ok/); anything else 404."""

    def do_GET(self):
        if self.path == "/ok/a.png":
            body, code = png(), 200
        elif self.path == "/ok/big.png":
            body, code = b"\x89PNG" + b"0" * 5000, 200
        elif self.path == "/ok/slow.png":              # one byte every 0.2 s: each read is quick, the whole is not
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            try:
                for _ in range(100):
                    self.wfile.write(b"0")
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:
                pass
            return
        elif self.path == "/ok/moved.png":
            self.send_response(302)
            self.send_header("Location", "/private/secret.png")
            self.end_headers()
            return
        else:
            body, code = b"no", 404
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass
