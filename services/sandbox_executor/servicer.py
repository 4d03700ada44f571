"""Sandbox gRPC: Execute (unary) and ExecuteBatch (streaming), sharing the pool with the Kafka consumer."""
from __future__ import annotations

import asyncio

import grpc

from crucible.v1 import execution_pb2, execution_pb2_grpc
from crucible.services.sandbox_executor.handler import job_for_request, result_message
from crucible.services.sandbox_executor.pool import JobRejected, PoolFull, SandboxPool
from crucible.shared import integrity, rpc


class SandboxServicer(execution_pb2_grpc.SandboxServicer):
    def __init__(self, pool: SandboxPool, secret: bytes):
        self.pool = pool
        self.secret = secret  # every result is sealed for the job it ran (shared/integrity.py)

    def _reply(self, request, result) -> execution_pb2.ExecuteResponse:
        return execution_pb2.ExecuteResponse(request_id=request.request_id,
                                             result=integrity.seal(result_message(result), request, self.secret))

    async def Execute(self, request: execution_pb2.ExecuteRequest, context):
        try:
            result = await self.pool.execute(job_for_request(request))
        except (ValueError, JobRejected) as exc:
            await rpc.abort_invalid(context, f"request {request.request_id!r}: {exc}")
        except PoolFull as exc:
            await rpc.abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; retry with backoff")
        return self._reply(request, result)

    async def ExecuteBatch(self, request_iterator, context):
        """Results stream back as jobs finish; a rejected request gets a response with `error` set.

        Bounded for a client that stops reading: a request is taken only while fewer than `pool.size`
        are between being taken and their reply being handed to gRPC (whose own flow control then
        holds the stream), so nothing piles up here however slow the reader."""
        results: asyncio.Queue = asyncio.Queue(maxsize=self.pool.size)
        slots = asyncio.Semaphore(self.pool.size)
        total = asyncio.get_running_loop().create_future()
        running: set[asyncio.Task] = set()

        async def run(request):
            try:
                result = await self.pool.execute(job_for_request(request))
                reply = self._reply(request, result)
            except (ValueError, JobRejected) as exc:
                reply = execution_pb2.ExecuteResponse(request_id=request.request_id, error=f"INVALID_ARGUMENT: {exc}")
            except PoolFull as exc:
                reply = execution_pb2.ExecuteResponse(request_id=request.request_id,
                                                      error=f"RESOURCE_EXHAUSTED: {exc}")
            except Exception as exc:  # a worker crash: report it on this request, keep the stream going
                reply = execution_pb2.ExecuteResponse(request_id=request.request_id, error=f"INTERNAL: {exc}")
            await results.put(reply)

        async def feed():
            count = 0
            async for request in request_iterator:
                await slots.acquire()  # released when this request's reply has been handed on
                task = asyncio.create_task(run(request))
                running.add(task)
                task.add_done_callback(running.discard)
                count += 1
            total.set_result(count)

        feeder = asyncio.create_task(feed())
        sent = 0
        getter = None
        try:
            while not (total.done() and sent >= total.result()):
                if feeder.done() and feeder.exception() is not None:
                    raise feeder.exception()
                getter = asyncio.ensure_future(results.get())
                await asyncio.wait({getter, total, feeder} if not total.done() else {getter},
                                   return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    continue
                sent += 1
                slots.release()
                yield getter.result()
        finally:
            feeder.cancel()
            if getter is not None:  # a stream cancelled while waiting: its wait must not outlive it
                getter.cancel()
            for task in list(running):
                task.cancel()
