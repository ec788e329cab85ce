"""The session routes: the WebSocket path of each protocol and of its viewers (which the ingress serves and the
door in Serve's proxy, front.py, counts), the recordings' and the saved worlds'."""
VLLM_ROUTE = "/v1/realtime/video"                 # the first protocol's WebSocket (vllm.py)
SGLANG_ROUTE = "/v1/realtime_video/generate"      # the second's (sglang.py)
# a shared session's viewers, by the owner's protocol (viewing.py): the route, then "/" and the watch id
WATCH_ROUTES = {"vllm": "/v1/realtime/watch", "sglang": "/v1/realtime_video/watch"}
RECORDING_ROUTE = "/v1/recordings"                # a finished recording: the route, "/" and its id (recordings.py)
WORLD_ROUTE = "/v1/worlds"                        # the saved worlds; "/" and an id: one of them (worlds.py)
