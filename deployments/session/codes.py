"""The refusal vocabulary of both protocols: every error code a client can receive, the WebSocket close codes,
and `ProtocolError`, the refusal itself. One table (`ErrorCode`); docs/architecture.md lists the same codes
(a test keeps them equal), and nothing else in the serving layer spells a code as a bare string.

Plain Python: no Ray, no Starlette."""
from __future__ import annotations

from enum import StrEnum
from typing import Optional

# WebSocket close codes
CLOSE_NORMAL = 1000
CLOSE_INVALID_DATA = 1007
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_SERVER_ERROR = 1011
CLOSE_TRY_AGAIN = 1013


class ErrorCode(StrEnum):
    """Stable codes, sent as strings (a StrEnum member is its value on every wire)."""
    # the message itself
    INVALID_JSON = "invalid_json"                    # not JSON, or not an object
    INVALID_MSGPACK = "invalid_msgpack"              # second protocol: not one MessagePack map
    TOO_DEEP = "too_deep"                            # containers nested past MAX_DEPTH (close 1007)
    TOO_COMPLEX = "too_complex"                      # past MAX_CONTAINERS or MAX_MAP_LEN (close 1007)
    NUMBER_TOO_LARGE = "number_too_large"            # an integer of more than MAX_INT_DIGITS digits (close 1007)
    MESSAGE_TOO_LARGE = "message_too_large"          # over max_start_bytes / max_control_bytes (close 1009)
    UNSUPPORTED_MESSAGE = "unsupported_message"      # binary on the first protocol, text on the second
    UNKNOWN_TYPE = "unknown_type"
    UNSUPPORTED_EVENT = "unsupported_event"          # second protocol: an event kind it does not know
    MISSING_FIELD = "missing_field"
    INVALID_FIELD = "invalid_field"
    TEXT_TOO_LONG = "text_too_long"                  # a prompt or an event id longer than parsing.py allows
    # the start
    INVALID_IMAGE = "invalid_image"
    IMAGES_BUSY = "images_busy"                      # every first-frame decode slot stayed taken (1013, retry_after_s)
    INVALID_SIZE = "invalid_size"
    UNSUPPORTED_SIZE = "unsupported_size"
    DECODER_NOT_LOADED = "decoder_not_loaded"        # a frame decoder this deployment did not load
    INVALID_NUM_FRAMES = "invalid_num_frames"
    TRAJECTORY_SHAPE = "trajectory_shape"
    TRAJECTORY_NOT_FINITE = "trajectory_not_finite"
    TRAJECTORY_NOT_RIGID = "trajectory_not_rigid"
    TRAJECTORY_INTRINSICS = "trajectory_intrinsics"
    TRAJECTORY_TOO_LONG = "trajectory_too_long"
    CONFLICTING_CAMERA = "conflicting_camera"
    # sequencing
    NOT_STARTED = "not_started"
    ALREADY_STARTED = "already_started"
    CAMERA_SCRIPTED = "camera_scripted"              # a camera or key event while the camera follows a path
    TOO_MANY_CONTROLS = "too_many_controls"          # max_queued_controls interactions wait already
    # access (deployments/ingress/access.py) and the door in Serve's proxy (front.py)
    UNAUTHORIZED = "unauthorized"
    HEADERS_TOO_LARGE = "headers_too_large"          # a handshake's headers over max_header_bytes (1008)
    ORIGIN_NOT_ALLOWED = "origin_not_allowed"
    HOST_NOT_ALLOWED = "host_not_allowed"            # a Host name not in allowed_hosts (DNS rebinding)
    TOO_MANY_SESSIONS = "too_many_sessions"
    TOO_MANY_CONNECTIONS = "too_many_connections"    # an address holds max_connections_per_address (1013)
    RATE_LIMITED = "rate_limited"                    # a key's starts, or a session's messages, too fast
    # spectators (deployments/session/audience.py, deployments/ingress/watch.py)
    WATCH_NOT_FOUND = "watch_not_found"              # no shared session has this watch id (unknown, ended, unshared)
    TOO_MANY_VIEWERS = "too_many_viewers"            # max_viewers_per_session, or the replica's max_viewers (1013)
    VIEWER_TOO_SLOW = "viewer_too_slow"              # a viewer fell behind viewer_max_skips times (1008)
    VIEWER_READ_ONLY = "viewer_read_only"            # a viewer sent something other than a keepalive (stays open)
    SHARING_OFF = "sharing_off"                      # session.share where max_viewers_per_session is 0
    RECORDING_NOT_FOUND = "recording_not_found"      # GET /v1/recordings: unknown, expired, not finished or not yours
    RECORDING_UNAVAILABLE = "recording_unavailable"  # record asked where recordings_dir cannot be written (kept on)
    RANGE_NOT_SATISFIABLE = "range_not_satisfiable"  # a Range header past a recording's end (416)
    # worlds (deployments/session/worlds.py)
    WORLD_NOT_FOUND = "world_not_found"              # no world has this id (unknown, expired, deleted or not yours)
    WORLD_CORRUPT = "world_corrupt"                  # a stored world that cannot be read back whole (1008)
    WORLD_MISMATCH = "world_mismatch"                # saved under settings that change the frames, not these (1008)
    WORLD_LIMIT = "world_limit"                      # a key's worlds or bytes, or a world's chunks, at their bound
    WORLDS_OFF = "worlds_off"                        # session.save or a world_id where worlds_dir is empty
    WORLD_UNAVAILABLE = "world_unavailable"          # the world store failed (a disk, a bucket): a server fault
    NOTHING_TO_SAVE = "nothing_to_save"              # session.save before the session's first chunk
    # time limits
    START_TIMEOUT = "start_timeout"
    STALL_TIMEOUT = "stall_timeout"
    IDLE_TIMEOUT = "idle_timeout"
    MAX_LIFETIME = "max_lifetime"
    # capacity and faults
    CAPACITY_EXHAUSTED = "capacity_exhausted"        # every group full (close 1013, retry_after_s)
    SERVER_BUSY = "server_busy"                      # the ingress serves max_ingress_sessions (1013, jittered)
    GROUP_UNAVAILABLE = "group_unavailable"          # every group failed, is being replaced or stopped (1013)
    INTERNAL_ERROR = "internal_error"                # a real server fault, never bad input (1011)


# a group that answers one of these may take the session on another try (Serve routes each try anew)
RETRYABLE = frozenset({ErrorCode.CAPACITY_EXHAUSTED, ErrorCode.GROUP_UNAVAILABLE})


class ProtocolError(Exception):
    """A refusal: a stable `code` (an ErrorCode; anything else is a bug and raises ValueError here), a
    human `message`; `close` is the WebSocket close code, None = the connection stays open. `extra` fields
    (retry_after_s, event_id) go to the client beside them."""

    def __init__(self, code: str, message: str, close: Optional[int] = None, **extra):
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message
        self.close = close
        self.extra = extra

    def to_message(self) -> dict:
        return {"type": "error", "code": self.code.value, "message": self.message, **self.extra}
