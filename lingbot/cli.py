"""`lingbot` command line: thin entry points over the library.

    lingbot presets                                   list the model presets
    lingbot write-checkpoint DIR [--preset tiny]      a random checkpoint in the real folder layout
    lingbot generate --image I --prompt P -o out.mp4  image + prompt + key script -> H.264 MP4 (.npy: uint8 frames)
        [--dtype bfloat16]                            ... with the DiT in another dtype than the preset's
        [--decoder tae --tae-path taew2_1.pth]        ... decoded by the tiny autoencoder
        [--save-latents L.npy]                        ... and the session's latents, to decode again
    lingbot decode --decoder wan|tae --latents L.npy -o out.mp4   saved latents -> frames, chunk by chunk
    lingbot trajectory --keys "w,wd,,i" [--json]      what the model receives for a key script
    lingbot trajectory --poses P.npy --intrinsics K.npy   ... for an offline camera path
    lingbot snapshot-budget [--sp 1,2,4,8] [--interval K]  host memory of the sessions' snapshots
"""
from __future__ import annotations

import argparse
import logging
import math
import sys
from typing import Optional

from .config import DECODERS, DTYPE_NAMES, LINGBOT_GEOMETRY, PRESETS, ConfigError
from .parallel.pixels import DEFAULT_PIXEL_MODE, PIXEL_MODES

log = logging.getLogger("lingbot")


def cmd_presets(args) -> None:
    for name, p in PRESETS.items():
        t = p.transformer
        print(f"{name:>22}: {p.width}x{p.height} {p.dtype}, dim {t.dim} ({t.num_attention_heads}x"
              f"{t.attention_head_dim}), {t.num_layers} layers, timesteps {list(p.sampler.timesteps)} "
              f"shift {p.sampler.shift} - {p.description}")


def cmd_snapshot_budget(args) -> None:
    from .config import get_preset, with_dtype
    from .runtime.snapshot_budget import GIB, budget_table
    presets = [with_dtype(get_preset(name), args.dtype) for name in (args.preset or list(PRESETS))]
    host = None if args.host_gib is None else int(args.host_gib * GIB)
    print(budget_table(presets, args.sp, args.interval, tuple(args.sessions), args.device == "cuda", host), end="")


def cmd_write_checkpoint(args) -> None:
    from .config import get_preset
    from .io.weights import write_random_checkpoint
    folder = write_random_checkpoint(get_preset(args.preset), args.output, seed=args.seed)
    print(f"wrote {args.preset} with random weights to {folder}")


def load_offline_trajectory(args, preset, chunks: Optional[int]):
    """--poses/--intrinsics (.npy) -> camera.Trajectory for `chunks` chunks (None: the whole file), or None."""
    if args.poses is None and args.intrinsics is None:
        return None
    if args.poses is None or args.intrinsics is None:
        raise ValueError("--poses and --intrinsics go together")
    import numpy as np

    from .camera import Trajectory
    g = preset.geometry
    poses = np.load(args.poses, allow_pickle=False)
    intrinsics = np.load(args.intrinsics, allow_pickle=False)
    return Trajectory.from_video_frames(poses, intrinsics, preset.width, preset.height, g.temporal_stride,
                                        max_video_frames=None if chunks is None else g.video_frames(chunks))


def chunks_for(args, frames_per_chunk: int, trajectory, default: Optional[int] = None) -> int:
    """--chunks; else `default` unless an offline path is given; else enough chunks for the key script and
    the offline path (at least one)."""
    if args.chunks is not None:
        return args.chunks
    if default is not None and trajectory is None:
        return default
    given = len(args.keys.split(",")) if args.keys else 0
    if trajectory is not None:
        given = max(given, len(trajectory))
    return max(1, math.ceil(given / frames_per_chunk))


def cmd_trajectory(args) -> None:
    import json

    from .camera import parse_key_script, trajectory
    from .config import get_preset
    preset = get_preset(args.preset)
    frames_per_chunk = preset.transformer.num_frames_per_block
    offline = load_offline_trajectory(args, preset, args.chunks)
    chunks = chunks_for(args, frames_per_chunk, offline)
    frames = trajectory(parse_key_script(args.keys, chunks, frames_per_chunk), preset.width, preset.height, offline)
    if args.json:
        print(json.dumps(frames))
        return
    print(f"{'frame':>5} {'translation (model units)':>30} {'pitch':>7} {'yaw':>7}   position")
    for f in frames:
        t = ", ".join(f"{v:6.3f}" for v in f["translation"])
        pos = ", ".join(f"{row[3]:6.3f}" for row in f["c2w"][:3])
        print(f"{f['frame']:>5} {t:>30} {f['pitch_deg']:>7.1f} {f['yaw_deg']:>7.1f}   {pos}")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_int_list(text: str) -> list[int]:
    try:
        return [positive_int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be positive integers separated by commas, got {text!r}") from None


def _generate(comm, args) -> int:
    """Generate on one rank (comm None: in process); rank 0 writes the frames (and the latents) and shows
    progress."""
    from pathlib import Path

    import numpy as np
    import torch
    from tqdm import tqdm

    from .builder import build_pipeline
    from .camera import CameraRig, Controls, parse_key_script
    from .config import get_preset
    from .io.images import load_image
    from .io.video import open_frame_writer
    root = comm is None or comm.is_root
    preset = get_preset(args.preset)
    frames_per_chunk = preset.transformer.num_frames_per_block
    offline = load_offline_trajectory(args, preset, args.chunks)
    chunks = chunks_for(args, frames_per_chunk, offline, default=4)
    controls = [Controls(keys=keys) for keys in parse_key_script(args.keys, chunks, frames_per_chunk)]
    image = load_image(args.image, preset.width, preset.height)
    pipeline = build_pipeline(preset, args.model_path, device=args.device, comm=comm, pixel_mode=args.pixel_mode,
                              skip_fixed_point=not args.no_fixed_point_skip, compile=args.compile, dtype=args.dtype,
                              decoder=args.decoder, tae_path=args.tae_path)
    session = pipeline.new_session(image, args.prompt, seed=args.seed,
                                   rig=CameraRig.default(preset.width, preset.height, offline))
    writer, latents = None, []
    if root:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        writer = open_frame_writer(out, preset.width, preset.height, args.fps)
    with tqdm(total=chunks, unit="chunk", desc="generating", file=sys.stderr, disable=not root) as bar:
        for chunk_controls in controls:
            chunk = session.step(chunk_controls, keep_latents=args.save_latents is not None)
            if writer is not None:
                writer.write(chunk.frames.cpu().numpy())
                bar.set_postfix(frames=writer.frames_written)
                if args.save_latents is not None:
                    latents.append(chunk.latents.float().cpu())
            bar.update()
    if writer is None:
        return 0
    writer.close()
    sp = f", SP-{comm.world_size} {args.pixel_mode}" if comm is not None else ""
    print(f"wrote {writer.frames_written} frames ({preset.width}x{preset.height}, {args.fps} fps{sp}, "
          f"{args.decoder} decoder) to {args.output}")
    if args.save_latents is not None:                       # NCTHW float32, the chunks concatenated on T
        np.save(args.save_latents, torch.cat(latents, dim=1)[None].numpy())
        print(f"wrote the latents of {chunks} chunks to {args.save_latents}")
    return writer.frames_written


def cmd_generate(args) -> None:
    if args.sp == 1:
        _generate(None, args)
        return
    from .parallel.launch import run_local
    if args.device != "cpu":
        raise ValueError("--sp > 1 launches local CPU ranks; on GPUs run the Ray Serve app (deployments/)")
    run_local(_generate, args.sp, args, timeout_s=args.timeout)


def cmd_decode(args) -> None:
    """Saved latents (NCTHW float32, `generate --save-latents`) -> frames, chunk by chunk as a session does."""
    from pathlib import Path

    import numpy as np
    import torch

    from .builder import build_frame_decoder
    from .config import get_preset
    from .io.video import open_frame_writer
    from .runtime.pipeline import decode_latents
    preset = get_preset(args.preset)
    latents = np.load(args.latents, allow_pickle=False)
    z = preset.vae.z_dim
    if latents.ndim != 5 or latents.shape[:2] != (1, z):
        raise ValueError(f"latents {args.latents} must be NCTHW [1, {z}, T, h, w], got {list(latents.shape)}")
    decoder = build_frame_decoder(preset, args.decoder, args.model_path, args.tae_path, device=args.device)
    stride = preset.vae.spatial_stride
    height, width = latents.shape[3] * stride, latents.shape[4] * stride
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = open_frame_writer(out, width, height, args.fps)
    x = torch.from_numpy(latents[0]).to(args.device, torch.float32)
    for frames in decode_latents(decoder, x, preset.transformer.num_frames_per_block):
        writer.write(frames.cpu().numpy())
    writer.close()
    print(f"wrote {writer.frames_written} frames ({width}x{height}, {args.decoder} decoder) to {args.output}")


def add_decoder_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decoder", default="wan", choices=DECODERS,
                   help="latents -> pixels: wan (the Wan VAE's decoder, exact) or tae (the tiny autoencoder, "
                        "approximate, 25x fewer FLOPs)")
    p.add_argument("--tae-path", default=None,
                   help="the tiny decoder's weights: taew2_1.pth or taew2_1.safetensors (github.com/madebyollin/"
                        "taehv); random-weight presets use random ones without it")


def add_trajectory_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--poses", default=None, help="offline camera path: .npy of per video frame camera-to-world "
                                                 "poses [F, 4, 4] (OpenCV axes), resampled to latent frames")
    p.add_argument("--intrinsics", default=None,
                   help="with --poses: .npy of [F, 4] fx, fy, cx, cy given at 832x480, scaled to the preset size")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lingbot", description="LingBot-World engine commands")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("presets", help="list the model presets")
    p.set_defaults(func=cmd_presets)
    p = sub.add_parser("snapshot-budget", help="host memory of the sessions' snapshots per preset and SP degree: "
                                               "bytes per chunk, held per session, for N sessions")
    p.add_argument("--preset", action="append", choices=sorted(PRESETS), help="a preset (repeatable; default: all)")
    p.add_argument("--sp", type=positive_int_list, default=[1, 2, 4, 8], help="SP degrees, e.g. 1,2,4,8")
    p.add_argument("--interval", type=positive_int, default=1, help="snapshot_interval_chunks")
    p.add_argument("--sessions", type=positive_int_list, default=[1, 2, 4, 8], help="session counts, e.g. 1,2,4,8")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda: the ranks' copies in pinned power-of-two blocks; cpu: plain copies")
    p.add_argument("--dtype", default=None, choices=DTYPE_NAMES, help="the DiT's dtype instead of the preset's")
    p.add_argument("--host-gib", type=float, default=None, help="also: sessions whose snapshots fit in this")
    p.set_defaults(func=cmd_snapshot_budget)
    p = sub.add_parser("write-checkpoint", help="write a preset with random weights in the real folder layout")
    p.add_argument("output", help="folder to write (transformer/, text_encoder/, tokenizer/, model_index.json)")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--seed", type=int, default=None, help="weights seed (default: the preset's)")
    p.set_defaults(func=cmd_write_checkpoint)
    p = sub.add_parser("trajectory", help="per latent frame: the pose, the scaled translation, pitch and yaw "
                                          "the model receives for a key script")
    p.add_argument("--keys", default="", help='one key set per latent frame, e.g. "w,wd,,i"')
    p.add_argument("--chunks", type=positive_int, default=None,
                   help="chunks (default: enough for the keys and the offline path)")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    add_trajectory_arguments(p)
    p.add_argument("--json", action="store_true", help="a JSON list, one object per latent frame")
    p.set_defaults(func=cmd_trajectory)
    p = sub.add_parser("generate", help="image + prompt + key script -> H.264 MP4, chunk by chunk")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--model-path", default=None,
                   help="diffusers-format folder (transformer/, vae/, text_encoder/, tokenizer/); "
                        "default: the preset's random weights (tiny only)")
    p.add_argument("--image", required=True, help="first frame (any image PIL reads); resized to the preset size")
    p.add_argument("--prompt", required=True)
    p.add_argument("--keys", default="", help='one key set per latent frame, e.g. "w,w,wa,,j" (W/A/S/D move, '
                                              'I/K pitch, J/L yaw); missing frames get no keys')
    add_trajectory_arguments(p)
    g = LINGBOT_GEOMETRY
    p.add_argument("--chunks", type=positive_int, default=None,
                   help=f"chunks to generate ({g.pixel_frames(0)} frames, then {g.pixel_frames(1)} per chunk; "
                        f"default: 4, or enough for --poses)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fps", type=float, default=16.0)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, npu, ...")
    p.add_argument("--dtype", default=None, choices=DTYPE_NAMES,
                   help="the DiT's (and text encoder's) dtype instead of the preset's, e.g. bfloat16 to run a GPU's "
                        "numbers on the CPU; the VAE keeps the preset's vae_dtype (float32)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="regional torch.compile of the DiT blocks (default: on for cuda/npu, off for cpu)")
    p.add_argument("--no-fixed-point-skip", action="store_true",
                   help="always run the condition encoder (the reference path)")
    p.add_argument("--sp", type=positive_int, default=1,
                   help="sequence-parallel degree: spawn this many local gloo ranks on this CPU machine")
    p.add_argument("--pixel-mode", default=DEFAULT_PIXEL_MODE, choices=PIXEL_MODES,
                   help="how decoded pixels reach rank 0 under --sp")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout (s) under --sp")
    add_decoder_arguments(p)
    p.add_argument("--save-latents", default=None,
                   help="also write the session's latents to this .npy (NCTHW float32, the DiT's normalised output, "
                        "the chunks concatenated on T) for `lingbot decode`")
    p.add_argument("-o", "--output", required=True, help="output .mp4 (H.264), or .npy for the exact uint8 frames")
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("decode", help="saved latents (generate --save-latents) -> .mp4 or .npy frames, decoded "
                                      "chunk by chunk as a session decodes them")
    p.add_argument("--latents", required=True, help=".npy of NCTHW float32 latents [1, 16, T, h, w]")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                   help="the model the latents came from: its chunk length and random weights")
    p.add_argument("--model-path", default=None, help="with --decoder wan: the model folder whose vae/ decodes")
    add_decoder_arguments(p)
    p.add_argument("--fps", type=float, default=16.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("-o", "--output", required=True, help="output .mp4 (H.264), or .npy for the exact uint8 frames")
    p.set_defaults(func=cmd_decode)
    return parser


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ConfigError, ValueError, FileNotFoundError, OSError) as e:
        print(f"lingbot: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
