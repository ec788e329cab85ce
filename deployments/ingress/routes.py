"""The session routes: the WebSocket path of each protocol, which the ingress serves and the door in Serve's proxy
(front.py) counts."""
VLLM_ROUTE = "/v1/realtime/video"                 # the first protocol's WebSocket (vllm.py)
SGLANG_ROUTE = "/v1/realtime_video/generate"      # the second's (sglang.py)
