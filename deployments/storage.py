"""Where finished files of the server live (recordings today): a folder or any fsspec URL, through one code path.

`Store("~/lingbot-recordings")` is a local folder; `Store("s3://bucket/prefix")`, `gs://`, `az://` and the rest
are fsspec's backends (their package, such as s3fs, installed beside); `memory://` is fsspec's in-process one
(tests). A file is written whole (`put_file` from a local file, `put_bytes`), read by byte range, listed with its
size and age, and deleted. `sweep` enforces retention and a quota over groups of files that share a stem (a
recording's video and journal go together), oldest first.

Blocking calls: the ingress runs them off its event loop. No Ray here."""
from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import fsspec
from fsspec.implementations.local import LocalFileSystem


@dataclass(frozen=True)
class Stored:
    name: str
    size: int
    modified: float          # seconds since the epoch


def _modified(info: dict) -> float:
    """A listing entry's modification time, whichever backend wrote it (local mtime, memory's created, S3's
    LastModified, GCS's updated)."""
    for key in ("mtime", "created", "LastModified", "last_modified", "updated"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, str):
            try:
                return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
        return float(value)
    return time.time()


def stem(name: str) -> str:
    """The group a file belongs to: its name up to the first dot."""
    return name.split(".", 1)[0]


class Store:
    def __init__(self, url: str):
        local = "://" not in url
        self.fs, root = fsspec.core.url_to_fs(os.path.expanduser(url) if local else url)
        self.root = root.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)
        self.fs.makedirs(self.root, exist_ok=True)

    def path(self, name: str) -> str:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"{name!r} is not a plain file name")
        return f"{self.root}/{name}"

    def spool_dir(self) -> Path:
        """A local folder for files in the making: under the store's folder when it is local (a finished file is
        then renamed into place), else in the system's temporary folder."""
        import tempfile
        base = Path(self.root) / ".spool" if self.local else Path(tempfile.gettempdir()) / "lingbot-spool"
        base.mkdir(parents=True, exist_ok=True)
        return base

    def put_file(self, local: Path, name: str) -> None:
        """Store a finished local file under `name` (moved: the local file is gone afterwards)."""
        if self.local:
            os.replace(local, self.path(name))
        else:
            self.fs.put_file(str(local), self.path(name))
            local.unlink()

    def put_bytes(self, name: str, data: bytes) -> None:
        self.fs.pipe_file(self.path(name), data)

    def get_bytes(self, name: str) -> Optional[bytes]:
        try:
            return self.fs.cat_file(self.path(name))
        except FileNotFoundError:
            return None

    def size(self, name: str) -> Optional[int]:
        try:
            return int(self.fs.size(self.path(name)))
        except FileNotFoundError:
            return None

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of a stored file."""
        return self.fs.cat_file(self.path(name), start=start, end=end)

    def delete(self, name: str) -> None:
        try:
            self.fs.rm_file(self.path(name))
        except FileNotFoundError:
            pass

    def files(self) -> list[Stored]:
        entries = self.fs.ls(self.root, detail=True)
        out = []
        for info in entries:
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            if info.get("type") == "file" and not name.startswith("."):
                out.append(Stored(name, int(info.get("size") or 0), _modified(info)))
        return out

    def sweep(self, keep_s: float, max_bytes: int, busy: frozenset[str] = frozenset(),
              now: Optional[float] = None) -> list[str]:
        """Delete the groups of files (by stem) older than `keep_s`, then the oldest until they hold at most
        `max_bytes` in all; groups in `busy` are never deleted. Returns the stems deleted, oldest first."""
        now = time.time() if now is None else now
        groups: dict[str, list[Stored]] = {}
        for f in self.files():
            groups.setdefault(stem(f.name), []).append(f)
        ordered = sorted(groups.items(), key=lambda kv: min(f.modified for f in kv[1]))
        total = sum(f.size for files in groups.values() for f in files)
        gone = []
        for key, files in ordered:
            if key in busy:
                continue
            expired = now - min(f.modified for f in files) > keep_s
            if not expired and total <= max_bytes:
                continue
            for f in files:
                self.delete(f.name)
            total -= sum(f.size for f in files)
            gone.append(key)
        return gone
