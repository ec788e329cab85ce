"""Waiting for a condition with a deadline: what a test does instead of sleeping a fixed time and then asserting.
A fixed sleep is too short on a loaded machine and too long on an idle one; these helpers ask again until the
condition holds, and past the deadline fail with an AssertionError that names what they waited for."""
import asyncio
import inspect
import time


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    """Call `predicate()` every `interval_s` until it gives a true value, and return that value; after
    `timeout_s` without one, AssertionError("waited ... for <what>")."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout_s:g} s for {what}")
        time.sleep(interval_s)


async def async_wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.01):
    """wait_until on an event loop: the loop runs between the calls, and `predicate()` may give an awaitable
    (its result is the value)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout_s:g} s for {what}")
        await asyncio.sleep(interval_s)
