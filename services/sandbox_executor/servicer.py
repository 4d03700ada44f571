"""Sandbox gRPC: Execute (unary) and ExecuteBatch (streaming), sharing the pool with the Kafka consumer."""
from __future__ import annotations

import asyncio

import grpc

from crucible.v1 import execution_pb2, execution_pb2_grpc
from crucible.services.sandbox_executor.handler import job_for_request, result_message
from crucible.services.sandbox_executor.pool import JobRejected, PoolFull, SandboxPool
from crucible.shared import rpc


class SandboxServicer(execution_pb2_grpc.SandboxServicer):
    def __init__(self, pool: SandboxPool):
        self.pool = pool

    async def Execute(self, request: execution_pb2.ExecuteRequest, context):
        try:
            result = await self.pool.execute(job_for_request(request))
        except (ValueError, JobRejected) as exc:
            await rpc.abort_invalid(context, f"request {request.request_id!r}: {exc}")
        except PoolFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; retry with backoff")
        return execution_pb2.ExecuteResponse(request_id=request.request_id, result=result_message(result))

    async def ExecuteBatch(self, request_iterator, context):
        """Results stream back as jobs finish; a rejected request gets a response with `error` set."""
        results: asyncio.Queue = asyncio.Queue()
        in_flight = asyncio.Semaphore(self.pool.size)  # read requests no faster than workers take them

        async def run(request):
            try:
                result = await self.pool.execute(job_for_request(request))
                reply = execution_pb2.ExecuteResponse(request_id=request.request_id, result=result_message(result))
            except (ValueError, JobRejected) as exc:
                reply = execution_pb2.ExecuteResponse(request_id=request.request_id, error=f"INVALID_ARGUMENT: {exc}")
            except PoolFull as exc:
                reply = execution_pb2.ExecuteResponse(request_id=request.request_id,
                                                      error=f"RESOURCE_EXHAUSTED: {exc}")
            except Exception as exc:  # a worker crash: report it on this request, keep the stream going
                reply = execution_pb2.ExecuteResponse(request_id=request.request_id, error=f"INTERNAL: {exc}")
            finally:
                in_flight.release()
            await results.put(reply)

        async def feed():
            count = 0
            async for request in request_iterator:
                await in_flight.acquire()
                asyncio.create_task(run(request))
                count += 1
            await results.put(count)  # sentinel: how many replies to expect

        feeder = asyncio.create_task(feed())
        expected, sent = None, 0
        try:
            while expected is None or sent < expected:
                item = await results.get()
                if isinstance(item, int):
                    expected = item
                    continue
                sent += 1
                yield item
        finally:
            feeder.cancel()
