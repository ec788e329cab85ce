"""The Ray Serve application: the only package that knows Ray (docs/architecture.md).

ingress.py (WebSocket sessions) -> group.py (one replica = one SP group: rank actors + muxer) ->
rank.py (the engine on one rank) and muxer.py (fMP4 per session, control mailbox). app.py builds it."""
