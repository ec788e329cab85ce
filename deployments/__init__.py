"""The Ray Serve application: the only package that knows Ray (docs/architecture.md, "The layers").

session/ a session's life, ledger, scheduling and events (plain Python: no Ray, no Starlette) ·
ingress/ the HTTP app, one file per wire dialect, the access checks, the door in Serve's proxy, the snapshot keeper ·
group/ one replica = one SP group: its phase, the rank executor, the chunk loop, the drain, the rank worker,
muxer and mailbox · client/ the WebSocket clients of both protocols (`python -m deployments.client`; they import
no Ray, nor does this file) · settings.py, metrics.py, app.py (the builder)."""
