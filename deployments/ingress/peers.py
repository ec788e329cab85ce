"""The peers' HTTP descriptions of a server, answered from what the groups run (ModelFacts) and the settings,
never from constants: SGLang's diffusion server (`GET /models`, `GET /server_info`) and vLLM's OpenAI-style
server (`GET /v1/models`, `GET /version`; its `GET /health` is a route of the ingress). Benchmark clients of
either read them before they open a session. Plain Python."""
from __future__ import annotations

from importlib import metadata
from typing import Any

from ..session.events import ModelFacts

SERVED_MODEL = "lingbot-world"             # the model name clients send (`model`) and /v1/models lists
PIPELINE = ("lingbot_world", "WorldPipeline")   # SGLang's pipeline_name, pipeline_class
TASK = "I2V"                               # a first frame and a prompt to video (camera-controlled)
_PRECISION = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def version() -> str:
    try:
        return metadata.version("lingbot-serve")
    except metadata.PackageNotFoundError:      # run from a checkout that was never installed
        return "0+unknown"


def precision(dtype: str) -> str:
    """SGLang's spelling of a dtype (bf16, fp16, fp32)."""
    return _PRECISION.get(dtype, dtype)


def model_path(facts: ModelFacts, settings) -> str:
    """The checkpoint the groups load, or `random:<preset>` for seeded random weights (no checkpoint)."""
    return f"random:{facts.preset}" if facts.random_weights or not settings.model_path else settings.model_path


def sglang_models(facts: ModelFacts, settings) -> dict[str, Any]:
    """SGLang diffusion's `GET /models`: the model, its pipeline and precision, the devices one group runs on."""
    return {"model_path": model_path(facts, settings), "task_type": TASK, "pipeline_name": PIPELINE[0],
            "pipeline_class": PIPELINE[1], "num_gpus": settings.sp, "dit_precision": precision(facts.dtype),
            "vae_precision": precision(facts.vae_dtype)}


def realtime(facts: ModelFacts, settings) -> dict[str, Any]:
    """What a realtime session gets here: size, rate, chunk geometry, steps, the K/V window, the decoders."""
    g = facts.geometry
    return {"width": facts.width, "height": facts.height, "fps": settings.fps, "max_fps": settings.resolved_max_fps,
            "latent_frames_per_chunk": g.latent_frames, "frames_per_chunk": g.pixel_frames(1),
            "first_chunk_frames": g.pixel_frames(0), "num_inference_steps": facts.steps,
            "causal_sink_chunks": facts.sink_chunks, "causal_window_chunks": facts.window_chunks,
            "causal_sink_size": facts.sink_chunks * g.latent_frames,
            "causal_kv_cache_num_frames": facts.window_chunks * g.latent_frames,
            "decoders": list(facts.decoders), "default_chunks": settings.default_chunks,
            "max_chunks": settings.max_chunks, "max_sessions_per_group": settings.max_sessions_per_group,
            "min_groups": settings.min_groups, "max_groups": settings.max_groups}


def sglang_server_info(facts: ModelFacts, settings) -> dict[str, Any]:
    """SGLang diffusion's `GET /server_info`: its version and server settings, here the model's description and
    the served realtime settings (`realtime`)."""
    return {"version": version(), "served_model_name": SERVED_MODEL, **sglang_models(facts, settings),
            "preset": facts.preset, "sp_size": settings.sp, "device": settings.device,
            "random_weights": facts.random_weights, "realtime": realtime(facts, settings)}


def openai_models(facts: ModelFacts, settings, created: int) -> dict[str, Any]:
    """vLLM's (OpenAI's) `GET /v1/models`: one model card, created when this ingress started."""
    return {"object": "list", "data": [{"id": SERVED_MODEL, "object": "model", "created": created,
                                        "owned_by": "lingbot-serve", "root": model_path(facts, settings),
                                        "parent": None}]}
