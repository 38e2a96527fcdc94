"""Awaiting a request's choice streams over HTTP: side by side, cancelled when the client goes
away (an SSE response that listens for the disconnect, or a plain await that does)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from router.errors import APIError
from router.generation import TextDelta

T = TypeVar("T")


async def all_of(works: list[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run ``works`` side by side; their results in order. The first APIError cancels the
    rest and is raised as itself (not wrapped in an exception group)."""
    if len(works) == 1:
        return [await works[0]()]
    results: list[Any] = [None] * len(works)
    errors: list[APIError] = []

    async def run(i: int, scope: anyio.CancelScope) -> None:
        try:
            results[i] = await works[i]()
        except APIError as err:
            errors.append(err)
            scope.cancel()

    async with anyio.create_task_group() as tg:
        for i in range(len(works)):
            tg.start_soon(run, i, tg.cancel_scope)
    if errors:
        raise errors[0]
    return results


async def collect(stream) -> list[TextDelta]:
    return [delta async for delta in stream]


async def close_all(streams) -> None:
    with anyio.CancelScope(shield=True):
        for stream in streams:
            await stream.aclose()  # cancels its request unless it finished


async def unless_disconnected(
    http: Request, work: Callable[[], Awaitable[T]]
) -> tuple[bool, T | None]:
    """Run ``work()`` unless the client disconnects first; then it is cancelled (which closes
    the generation it awaits, cancelling the request) and (False, None) returned."""
    result: T | None = None
    finished = False
    error: APIError | None = None

    async def watch(scope: anyio.CancelScope) -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch, tg.cancel_scope)
        try:
            result = await work()
            finished = True
        except APIError as err:  # re-raised below, not wrapped in an exception group
            error = err
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return finished, result


class EventStreamResponse(StreamingResponse):
    """Server-sent events that stop, and close their generator, when the client disconnects.

    Starlette only notices a disconnect on its next write under ASGI 2.4; this listens for
    it all along, so a request waiting on its first token is cancelled at once.
    """

    media_type = "text/event-stream"

    def __init__(self, content) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        async def stream(scope_: anyio.CancelScope) -> None:
            try:
                await self.stream_response(send)
            except OSError:
                pass  # the client is gone
            scope_.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream, tg.cancel_scope)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
