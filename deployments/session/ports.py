"""The ports of a session's life (deployments/session/life.py): what it needs from the outside, as protocols.
The ingress implements them with a Starlette WebSocket (a `Wire` per protocol dialect) and Ray Serve's handle
(the `GroupLink`); tests implement them with their own.

Plain Python: no Ray, no Starlette."""
from __future__ import annotations

from typing import Any, Optional, Protocol

from .codes import ErrorCode, ProtocolError
from .events import Admitted, ChunkReady, ModelFacts, Resumed, SessionRequest
from .requests import Interaction, StartRequest
from .waiting import Growth

STOP = "stop"                  # Wire.control: the client stops the session
ACTIVITY = "activity"          # Wire.control: a message that only says the client is there (a heartbeat)
SHARE = "share"                # Wire.control: the owner makes the session watchable (session.audience.py)
UNSHARE = "unshare"            # Wire.control: the owner ends its sharing (every viewer is told)
SAVE = "save"                  # Wire.control: the owner saves its world (session/worlds.py)


class ClientGone(Exception):
    """The client closed the connection or left (the wire's receive raises it)."""


class Wire(Protocol):
    """One protocol dialect over one connection (deployments/ingress/vllm.py, sglang.py)."""

    async def receive(self, timeout: float) -> Any:
        """The next message as it arrived, not decoded yet (ClientGone at the end, TimeoutError)."""

    async def decode(self, raw: Any, limit: int, start: bool) -> dict:
        """A received message decoded and checked (ProtocolError when bad): at most `limit` bytes; as many containers
        as a start may hold (`start`: a camera trajectory) or far fewer (any later message: a few dozen); a large
        one decoded off the event loop."""

    async def send(self, data) -> None:
        """One message (a map or bytes) as it is."""

    def keepalive_reply(self, msg: dict) -> Optional[dict]:
        """The answer to a keepalive message (None: `msg` is not one)."""

    async def parse_start(self, msg: dict, facts: ModelFacts) -> StartRequest:
        """The start in `msg` (ProtocolError when it is not a valid start)."""

    def control(self, msg: dict, seq: int) -> Any:
        """A message during the session: STOP, ACTIVITY or an Interaction (`seq` its arrival number);
        ProtocolError when it is bad."""

    def queued(self, interaction: Interaction) -> Optional[dict]:
        """The acknowledgement of a posted interaction (None: the dialect sends none)."""

    def queued_message(self, position: int, eta_s: Optional[float]) -> Any:
        """The session waits for a group: its place in the queue (1: next) and the estimated wait (None:
        unknown yet)."""

    def limit_error(self, code: ErrorCode, text: str) -> ProtocolError:
        """The refusal that ends a session at its idle or lifetime limit."""

    async def send_error(self, error: ProtocolError) -> None:
        """A refusal that leaves the connection open."""

    async def close_with(self, error: ProtocolError) -> None:
        """A refusal that closes (bounded in time, never raising)."""

    async def send_admitted(self, admitted: Admitted, start: StartRequest, session_id: str) -> None:
        """Tell the client its session runs (the first protocol's video.start)."""

    async def send_chunk(self, event: ChunkReady, transport_index: int, send) -> bool:
        """Put one chunk on the wire through `send` (False: the connection is over)."""

    async def send_resumed(self, event: Resumed, chunk_index: int, transport_index: int, gap_s: float,
                           reason: str, send) -> bool:
        """Tell the client its session goes on after a fault or a drain."""

    async def finish(self, stopped: bool, chunks: int) -> None:
        """The session ended by itself (stopped False) or at the client's request: last words and the close."""

    # sharing (sharing.py): the owner's news, and the viewers' messages rendered once for all of them
    dialect: str                   # "vllm" or "sglang": a shared session is watched on its protocol's watch route

    def shared_message(self, watch_id: Optional[str], viewers: int) -> Any:
        """The owner told its session is watchable at `watch_id` (None: no longer shared)."""

    def recording_message(self, recording_id: str) -> Any:
        """The owner told its session is recorded, to be fetched by `recording_id` once it ended (the first
        protocol's wire only: the second protocol's sessions are not recorded)."""

    def saved_message(self, world_id: str, chunk_index: int) -> Any:
        """The owner told its world up to chunk `chunk_index` is stored as `world_id`."""

    def viewer_header(self, admitted: Admitted, start: StartRequest) -> dict:
        """What a viewer is told first about the stream (size, rate, mime or frame format; nothing the owner
        sent)."""

    def viewer_chunk(self, event: ChunkReady, transport_index: int, fragment: bytes, watch_id: str) -> tuple:
        """One chunk's messages for every viewer (`fragment`: its fMP4 part without the init segment), ready to
        send: metadata without event ids or controls, then the video."""


class GroupLink(Protocol):
    """The ingress's way to the groups."""

    async def facts(self) -> ModelFacts:
        """The model the groups run (what a start is checked against)."""

    def lease(self, request: SessionRequest) -> Any:
        """Open a session lease: an async iterator of GroupEvents with cancel()."""

    def post(self, mailbox: Any, session_id: str, interaction: Interaction) -> None:
        """Send an interaction to the mailbox of the session's group."""

    async def keeper(self) -> Any:
        """The owner of the sessions' snapshots (None: no snapshots)."""

    async def snapshots(self, keys: list[str]) -> list:
        """The snapshots the keeper holds under `keys`, fetched (a saved world keeps them); raises when it cannot."""

    async def keep_snapshots(self, session_id: str, slots: list, state: Any) -> Optional[list[str]]:
        """Give one rank's snapshots (read back from a saved world) to the keeper for `session_id`: their keys
        (the slots', then the state's); None when it keeps nothing for it."""

    def let_go(self, session_id: str, keys: Optional[list[str]] = None) -> None:
        """Tell the keeper to free the session's snapshots of `keys` (None: all, at the session's end)."""

    async def growth(self) -> Growth:
        """The groups running and starting, and a measured group start (whether a waiting session may wait)."""

    def want_keyframe(self, muxer: Any, session_id: str) -> None:
        """Ask the session's encoder for a keyframe at its next chunk (told, not awaited)."""


class SessionMetrics(Protocol):
    def refused(self, code: str) -> None: ...
    def admitted(self) -> None: ...
    def chunk_interval(self, seconds: float) -> None: ...
    def resumed(self, outcome: str, reason: str) -> None: ...
    def unknown_fields(self, count: int) -> None: ...
    def video_bytes(self, role: str, count: int) -> None: ...
    def recorded(self, outcome: str, count: int) -> None: ...
