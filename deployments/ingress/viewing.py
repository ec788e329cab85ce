"""What a shared session's viewers are sent, in each protocol's dialect (the wires inherit these), and the watch
route of each protocol (docs/architecture.md, "Many viewers").

The viewers' messages are rendered once per chunk for all of them (`viewer_chunk`): the owner's metadata
without its event ids, controls or anything else it sent, then the video. First protocol: a `watch.start` JSON
(size, rate, mime), a `video.init` JSON announcing the fMP4 init segment as the next binary message, then per
chunk `video.chunk_metadata` + the fragment (from a keyframe on), and `session.done` at the end. Second
protocol: a `watch_start` map (size, rate, frame format), then per chunk its frame batches and a `chunk_stats`
map without the owner's actions; the close (1000) ends it. The owner's own news of its sharing and its saved
worlds are here too."""
from __future__ import annotations

import json
from typing import Any, Optional

from ..session.audience import Ended
from ..session.codes import CLOSE_NORMAL
from ..session.events import Admitted, ChunkReady
from ..session.requests import StartRequest
from .closing import close_quietly, pack
from .routes import RECORDING_ROUTE, WATCH_ROUTES


def watch_path(dialect: str, watch_id: str) -> str:
    """The path a viewer opens (relative to the server's origin: the server does not know the name it is reached
    by; the page builds the full link)."""
    return f"{WATCH_ROUTES[dialect]}/{watch_id}"


class VllmViewing:
    """The first protocol's messages for sharing (VllmWire inherits them)."""
    dialect = "vllm"

    def shared_message(self, watch_id: Optional[str], viewers: int) -> dict:
        if watch_id is None:
            return {"type": "session.unshared"}
        return {"type": "session.shared", "watch_id": watch_id, "watch_url": watch_path(self.dialect, watch_id),
                "viewers": viewers}

    @staticmethod
    def saved_message(world_id: str, chunk_index: int) -> dict:
        return {"type": "session.saved", "world_id": world_id, "chunk_index": chunk_index}

    @staticmethod
    def recording_message(recording_id: str) -> dict:
        url = f"{RECORDING_ROUTE}/{recording_id}"
        return {"type": "session.recording", "recording_id": recording_id, "recording_url": url,
                "journal_url": f"{url}/journal"}

    def viewer_header(self, admitted: Admitted, start: StartRequest) -> str:
        config = {"width": start.width, "height": start.height, "fps": start.fps, "mime": admitted.mime,
                  "chunks": start.chunks, "endless": start.chunks is None}
        return json.dumps({"type": "watch.start", "format": "m4s", "config": config})

    @staticmethod
    def viewer_init(init: bytes) -> tuple:
        return (json.dumps({"type": "video.init", "byte_length": len(init)}), init)

    def viewer_chunk(self, event: ChunkReady, transport_index: int, fragment: bytes, watch_id: str) -> tuple:
        meta = {"type": "video.chunk_metadata", "kind": "media", "generation_chunk_index": event.index,
                "transport_chunk_index": transport_index, "num_frames": event.num_frames,
                "byte_length": len(fragment), "quality": event.quality, "denoising_steps": event.steps}
        return (json.dumps(meta), fragment)

    async def viewer_end(self, ended: Ended) -> None:
        await self.send({"type": "session.done", "chunks": ended.chunks, "stopped": ended.stopped})
        await close_quietly(self.ws, None, CLOSE_NORMAL)


class SglangViewing:
    """The second protocol's messages for sharing (SglangWire inherits them)."""
    dialect = "sglang"

    def shared_message(self, watch_id: Optional[str], viewers: int) -> bytes:
        if watch_id is None:
            return pack({"type": "unshared"})
        return pack({"type": "shared", "watch_id": watch_id, "watch_url": watch_path(self.dialect, watch_id),
                     "viewers": viewers})

    @staticmethod
    def saved_message(world_id: str, chunk_index: int) -> bytes:
        return pack({"type": "saved", "world_id": world_id, "chunk_index": chunk_index})

    def viewer_header(self, admitted: Admitted, start: StartRequest) -> bytes:
        return pack({"type": "watch_start", "width": start.width, "height": start.height, "fps": start.fps,
                     "realtime_output_format": start.output.kind, "content_type": start.output.content_type})

    @staticmethod
    def viewer_init(init: bytes) -> tuple:
        return ()

    def viewer_chunk(self, event: ChunkReady, transport_index: int, fragment: bytes, watch_id: str) -> tuple:
        width, height = self.size
        messages = self.batch_messages(watch_id, event.index, None, self.output, width, height, event.batches)
        stats: dict[str, Any] = {"type": "chunk_stats", "request_id": watch_id, "chunk_index": event.index,
                                 "num_batches": len(messages), "num_frames": event.num_frames,
                                 "content_type": self.output.content_type, "quality": event.quality,
                                 "denoising_steps": event.steps}
        return (*messages, pack(stats))

    async def viewer_end(self, ended: Ended) -> None:
        await close_quietly(self.ws, None, CLOSE_NORMAL, "unshared" if ended.unshared else "generation complete")
