"""Calls made on behalf of a Serve request that must not die with it.

Serve cancels a request with Ray's recursive cancel (client gone, session stopped), which also cancels the calls
the request made that have not run yet: their parent is the request's task, read from the caller's context. A
close or a release told from a cancelled request's `finally` was dropped that way now and then, leaving a
session on a rank, in the muxer or at the snapshot keeper. A call made from a fresh context has the actor's own
task as its parent instead."""
from __future__ import annotations

import asyncio
import contextvars


def fresh_task(coro) -> asyncio.Task:
    """A task in a fresh context: its actor calls must not count as children of the session request that
    happened to start it, or cancelling that request (client gone) would cancel every session's chunk."""
    return asyncio.get_running_loop().create_task(coro, context=contextvars.Context())


def outside_the_request(fn, *args):
    """Call fn(*args) now in a fresh context, for the same reason (the closes a lease's `finally` tells, the
    snapshots a session's end lets go)."""
    return contextvars.Context().run(fn, *args)
