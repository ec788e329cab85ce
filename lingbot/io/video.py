"""H.264 video out through PyAV: an MP4 file (CLI) or fragmented MP4 bytes (streaming).

The encoder is x264 (software) or NVENC (`h264_nvenc`, on nodes whose GPU driver provides it), both set
for low latency: no B-frames, no lookahead, so every frame's packet is out before the next frame.
"""
from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import BinaryIO, Optional, Union

import av
import numpy as np

log = logging.getLogger(__name__)

H264_ENCODERS = ("auto", "libx264", "h264_nvenc")


@dataclass(frozen=True)
class H264Settings:
    encoder: str = "libx264"       # libx264 | h264_nvenc (see pick_h264_encoder for "auto")
    preset: str = "veryfast"       # x264's preset; NVENC takes p1 (fastest) .. p7 and gets p1 otherwise
    crf: int = 23                  # quality (x264 CRF; NVENC constant quality)
    threads: int = 0               # encoder threads; 0: the codec's choice

    def stream_options(self) -> dict[str, str]:
        if self.encoder == "h264_nvenc":
            preset = self.preset if self.preset in {f"p{i}" for i in range(1, 8)} else "p1"
            # delay 0: no frames held back in NVENC's output queue (a chunk's fragment must hold all its frames)
            # forced-idr: a keyframe asked for (a viewer joining) is an IDR, where a decoder may start
            return {"preset": preset, "tune": "ull", "zerolatency": "1", "delay": "0", "bf": "0", "rc": "vbr",
                    "cq": str(self.crf), "forced-idr": "1"}
        return {"crf": str(self.crf), "preset": self.preset, "tune": "zerolatency"}


def pick_h264_encoder(preference: str = "auto", width: int = 832, height: int = 480) -> str:
    """The encoder to use: NVENC where it opens at the session size (asked for, or "auto"; NVENC refuses
    very small frames), else x264, the fallback everywhere."""
    if preference not in H264_ENCODERS:
        raise ValueError(f"H.264 encoder {preference!r} is not one of {list(H264_ENCODERS)}")
    if preference == "libx264":
        return preference
    try:
        container, stream = open_h264(io.BytesIO(), width, height, 16.0, H264Settings("h264_nvenc"))
        stream.encode(av.VideoFrame.from_ndarray(np.zeros((height, width, 3), np.uint8), format="rgb24"))
        container.close()
        return "h264_nvenc"
    except Exception as e:                     # no NVIDIA encoder on this node (or no driver for it)
        if preference == "h264_nvenc":
            log.warning("h264_nvenc does not open here (%s); encoding with libx264", str(e).splitlines()[0][:100])
        return "libx264"


def frame_rate(fps: float) -> Fraction:
    return Fraction(fps).limit_denominator(1000)


def open_h264(target: Union[str, BinaryIO], width: int, height: int, fps: float, settings: H264Settings,
              movflags: str = "") -> tuple:
    """An MP4 container writing one H.264 yuv420p stream. Returns (container, stream)."""
    if width % 2 or height % 2:
        raise ValueError(f"H.264 yuv420p needs an even size, got {width}x{height}")
    container = av.open(target, mode="w", format="mp4", options={"movflags": movflags} if movflags else {})
    stream = container.add_stream(settings.encoder, rate=frame_rate(fps))
    stream.width, stream.height = width, height
    stream.pix_fmt = "yuv420p"
    stream.options = settings.stream_options()
    stream.codec_context.thread_count = settings.threads
    return container, stream


class H264Writer:
    """Encodes uint8 RGB frames [F, H, W, 3] as H.264 yuv420p into an MP4 file."""

    def __init__(self, target: Union[str, Path, BinaryIO], width: int, height: int, fps: float, crf: int = 23,
                 preset: str = "veryfast"):
        target = str(target) if isinstance(target, Path) else target
        self.container, self.stream = open_h264(target, width, height, fps, H264Settings(crf=crf, preset=preset))
        self.frames_written = 0

    def write(self, frames: np.ndarray) -> None:
        for rgb in frames:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
            for packet in self.stream.encode(frame):
                self.container.mux(packet)
            self.frames_written += 1

    def close(self) -> None:
        for packet in self.stream.encode():
            self.container.mux(packet)
        self.container.close()


class NpyFrameWriter:
    """Collects uint8 RGB frames [F, H, W, 3] and saves them, exact, as one .npy array when closed (the
    lossless output of `lingbot generate` and `lingbot decode`, for comparing decoders bit for bit)."""

    def __init__(self, target: Union[str, Path]):
        self.target = Path(target)
        self.parts: list[np.ndarray] = []
        self.frames_written = 0

    def write(self, frames: np.ndarray) -> None:
        self.parts.append(np.asarray(frames, dtype=np.uint8))
        self.frames_written += len(frames)

    def close(self) -> None:
        np.save(self.target, np.concatenate(self.parts) if self.parts else np.zeros((0, 0, 0, 3), np.uint8))


def open_frame_writer(target: Union[str, Path], width: int, height: int, fps: float) -> H264Writer | NpyFrameWriter:
    """A writer of uint8 frames by the file's extension: `.npy` (the exact frames), any other an H.264 MP4."""
    if Path(target).suffix.lower() == ".npy":
        return NpyFrameWriter(target)
    return H264Writer(target, width, height, fps)


def read_frames(source: Union[str, Path, bytes]) -> np.ndarray:
    """Decode every frame of an MP4 (path or bytes) to uint8 RGB [F, H, W, 3]."""
    target = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else str(source)
    with av.open(target) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def remux_faststart(source: Union[str, Path], target: Union[str, Path], fps: float) -> int:
    """A fragmented MP4 stream (init segment + fragments, as FragmentedMp4Encoder writes them) -> one plain MP4
    with its index before the media (faststart: a player starts before the whole file arrived). The H.264 packets
    are copied, never re-encoded; frame i is timed i / fps. Returns the frames written."""
    rate = frame_rate(fps)
    with av.open(str(source)) as src, av.open(str(target), "w", format="mp4",
                                              options={"movflags": "+faststart"}) as out:
        stream = src.streams.video[0]
        copy = out.add_stream_from_template(stream)
        ticks = max(1, round(1 / (stream.time_base * rate)))     # one frame in the stream's time base
        frames = 0
        for packet in src.demux(stream):
            if packet.size == 0:                # the demuxer's flush packet
                continue
            packet.stream = copy
            packet.pts = packet.dts = frames * ticks     # no B-frames: decode order is display order
            packet.duration = ticks
            packet.time_base = stream.time_base
            out.mux(packet)
            frames += 1
    return frames


# ---------------------------------------------------------------------------------------------------
# fragmented MP4 for streaming: one moof + mdat per chunk, written as soon as the chunk is encoded
# ---------------------------------------------------------------------------------------------------
def _box(kind: bytes, payload: bytes) -> bytes:
    return (8 + len(payload)).to_bytes(4, "big") + kind + payload


def _full_box(kind: bytes, version: int, flags: int, payload: bytes) -> bytes:
    return _box(kind, bytes([version]) + flags.to_bytes(3, "big") + payload)


def annexb_to_avcc(data: bytes, drop_types=(7, 8, 9)) -> bytes:
    """Annex B (start codes) -> 4-byte length-prefixed NAL units, dropping SPS/PPS/AUD (they live in avcC)."""
    out = bytearray()
    i, n = 0, len(data)
    starts = []
    while i < n - 2:
        if data[i] == 0 and data[i + 1] == 0 and data[i + 2] == 1:
            starts.append(i + 3)
            i += 3
        else:
            i += 1
    for j, start in enumerate(starts):
        end = starts[j + 1] - 3 if j + 1 < len(starts) else n
        nal = data[start:end]
        while nal and nal[-1] == 0 and j + 1 < len(starts):      # the zero of a 4-byte start code
            nal = nal[:-1]
        if nal and (nal[0] & 0x1F) not in drop_types:
            out += len(nal).to_bytes(4, "big") + nal
    return bytes(out)


class FragmentedMp4Encoder:
    """H.264 encoder whose output is a byte stream Media Source Extensions play as it arrives.

    `encode_chunk(frames)` returns the bytes for one chunk: the init segment (ftyp + moov, from FFmpeg's
    mp4 muxer) before the first fragment, then exactly one moof + mdat with every frame of the chunk."""

    def __init__(self, width: int, height: int, fps: float, settings: H264Settings = H264Settings()):
        self._header = io.BytesIO()
        self._container, self.stream = open_h264(self._header, width, height, fps, settings,
                                                 movflags="frag_keyframe+empty_moov+default_base_moof")
        rate = frame_rate(fps)
        self._container.start_encoding()                     # opens the codec, writes ftyp + moov
        self.init_segment = self._header.getvalue()
        self.timescale = self.stream.time_base.denominator // self.stream.time_base.numerator
        self.frame_duration = round(self.timescale / rate)
        self.codec = self._codec_string(bytes(self.stream.codec_context.extradata or b""))
        self._sequence = 0
        self._next_pts = 0
        self._sent_init = False
        self.frames_encoded = 0

    @staticmethod
    def _codec_string(extradata: bytes) -> str:
        """avc1.PPCCLL from the SPS (profile, constraint flags, level) for MediaSource.isTypeSupported."""
        idx = extradata.find(b"\x00\x00\x01\x67")
        sps = extradata[idx + 4:idx + 7] if idx >= 0 else b"\x64\x00\x1f"
        return "avc1." + sps.hex()

    @property
    def mime(self) -> str:
        return f'video/mp4; codecs="{self.codec}"'

    def _fragment(self, packets: list) -> bytes:
        if not packets:
            return b""
        self._sequence += 1
        samples = [(annexb_to_avcc(bytes(p)), p.is_keyframe) for p in packets]
        base_time = self._next_pts - len(samples) * self.frame_duration
        trun_flags = 0x000001 | 0x000100 | 0x000200 | 0x000400      # data offset, duration, size, flags
        entries = b"".join(self.frame_duration.to_bytes(4, "big") + len(data).to_bytes(4, "big")
                           + (0x02000000 if key else 0x01010000).to_bytes(4, "big") for data, key in samples)

        def moof(data_offset: int) -> bytes:
            trun = _full_box(b"trun", 0, trun_flags,
                             len(samples).to_bytes(4, "big") + data_offset.to_bytes(4, "big", signed=True) + entries)
            traf = _box(b"traf", _full_box(b"tfhd", 0, 0x020000, (1).to_bytes(4, "big"))
                        + _full_box(b"tfdt", 1, 0, base_time.to_bytes(8, "big")) + trun)
            return _box(b"moof", _full_box(b"mfhd", 0, 0, self._sequence.to_bytes(4, "big")) + traf)

        size = len(moof(0))
        payload = b"".join(data for data, _ in samples)
        return moof(size + 8) + _box(b"mdat", payload)

    def continue_stream(self, fragments: int, frames: int) -> None:
        """Continue a stream another encoder began (a session resumed elsewhere): the client has the init
        segment, `fragments` fragments and `frames` frames, so the next fragment follows them in sequence
        number and time, and starts with a keyframe (this encoder's first frame)."""
        if self.frames_encoded:
            raise RuntimeError("continue_stream must come before the first chunk")
        self._sequence, self._next_pts, self._sent_init = fragments, frames * self.frame_duration, True
        self.frames_encoded = frames

    def encode_chunk(self, frames: np.ndarray, keyframe: bool = False) -> bytes:
        """uint8 RGB [F, H, W, 3] -> (init segment +) one fragment holding these F frames; `keyframe`: its first
        frame an IDR (a viewer joining the stream starts there)."""
        packets = []
        for i, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
            frame.pts = self.frames_encoded
            frame.time_base = self.stream.codec_context.time_base
            if keyframe and i == 0:
                frame.pict_type = av.video.frame.PictureType.I
            packets += self.stream.encode(frame)
            self.frames_encoded += 1
        self._next_pts += len(packets) * self.frame_duration
        out = self._fragment(packets)
        if not self._sent_init:
            out = self.init_segment + out
            self._sent_init = True
        return out


# ---------------------------------------------------------------------------------------------------
# reading what FragmentedMp4Encoder wrote: where its init segment ends, whether a fragment starts with a keyframe
# ---------------------------------------------------------------------------------------------------
def mp4_boxes(data: bytes, start: int = 0, end: Optional[int] = None) -> list[tuple[bytes, int, int]]:
    """The boxes between `start` and `end` of `data`, one level: (type, offset of the box, offset after it).
    ValueError where a size runs past the end (a truncated or foreign stream)."""
    end = len(data) if end is None else end
    boxes, i = [], start
    while i + 8 <= end:
        size = int.from_bytes(data[i:i + 4], "big")
        if size < 8 or i + size > end:
            raise ValueError(f"an MP4 box at byte {i} claims {size} bytes; {end - i} are left")
        boxes.append((bytes(data[i + 4:i + 8]), i, i + size))
        i += size
    if i != end:
        raise ValueError(f"{end - i} bytes after the last MP4 box")
    return boxes


def split_init_segment(data: bytes) -> tuple[bytes, bytes]:
    """(the init segment: ftyp + moov, the fragments after it) of a stream's first bytes; (b"", data) where it
    holds no init segment (a later chunk's fragment)."""
    boxes = mp4_boxes(data)
    cut = 0
    for kind, _, after in boxes:
        if kind not in (b"ftyp", b"moov"):
            break
        cut = after
    return bytes(data[:cut]), bytes(data[cut:])


def fragment_starts_with_keyframe(data: bytes) -> bool:
    """Whether the first sample of the first fragment (moof + mdat) in `data` is a sync sample (a decoder can
    start there): the sample flags of its track run, else of its track fragment header."""
    moof = next(((s, e) for kind, s, e in mp4_boxes(data) if kind == b"moof"), None)
    if moof is None:
        return False
    traf = next(((s, e) for kind, s, e in mp4_boxes(data, moof[0] + 8, moof[1]) if kind == b"traf"), None)
    if traf is None:
        return False
    default_flags = None
    for kind, s, _ in mp4_boxes(data, traf[0] + 8, traf[1]):
        flags = int.from_bytes(data[s + 9:s + 12], "big")
        if kind == b"tfhd":
            at = s + 16                                    # after the version/flags word and the track id
            at += 8 * bool(flags & 0x01) + 4 * bool(flags & 0x02) + 4 * bool(flags & 0x08) + 4 * bool(flags & 0x10)
            if flags & 0x20:
                default_flags = int.from_bytes(data[at:at + 4], "big")
        elif kind == b"trun":
            at = s + 16 + 4 * bool(flags & 0x01)           # after sample_count and the data offset
            if flags & 0x04:                               # first_sample_flags
                sample = int.from_bytes(data[at:at + 4], "big")
            elif flags & 0x400:                            # per-sample flags: the first entry's
                at += 4 * bool(flags & 0x4) + 4 * bool(flags & 0x100) + 4 * bool(flags & 0x200)
                sample = int.from_bytes(data[at:at + 4], "big")
            elif default_flags is not None:
                sample = default_flags
            else:
                return False
            return not sample & 0x00010000                 # sample_is_non_sync_sample clear
    return False
