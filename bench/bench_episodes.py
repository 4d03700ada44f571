"""Episodes per second for each environment, its reference solutions played through the real sandbox pool.

    python bench/bench_episodes.py [--episodes 64] [--concurrency 8]

For each built-in environment: `--episodes` tasks from its generator, each played with its reference
turns (crucible.ml.envs.episode.play: parse, route, act, observe, exactly the pipeline's steps; the
sandboxed tools through the jail pool with one worker per core), `--concurrency` at a time, then
scored. The baseline, measured in the same run: one-job episodes of `print(1)` through the same
pool, so each environment's figure reads as a ratio to the cheapest possible sandboxed turn.
Policy sampling is not included (the generator's cost is bench_generator.py's). Not a test.
"""
from __future__ import annotations

import argparse
import asyncio
import time

from crucible.ml import envs
from crucible.ml.envs import episode as ep
from crucible.services.sandbox_executor.handler import job_for_request, result_message
from crucible.services.sandbox_executor.pool import SandboxPool
from crucible.shared.settings import Settings
from crucible.v1 import execution_pb2


async def rate(play, count: int, concurrency: int) -> tuple[float, float]:
    """(episodes/s, mean turns) over `count` plays, `concurrency` at a time."""
    slots = asyncio.Semaphore(concurrency)

    async def one(i):
        async with slots:
            return await play(i)

    started = time.perf_counter()
    episodes = await asyncio.gather(*(one(i) for i in range(count)))
    elapsed = time.perf_counter() - started
    return count / elapsed, sum(len(e.turns) for e in episodes) / count


async def main(count: int, concurrency: int) -> None:
    async with SandboxPool(Settings(sandbox_workers=0)) as pool:
        async def execute(request):
            return result_message(await pool.execute(job_for_request(request)))

        async def baseline(i):
            await execute(execution_pb2.ExecuteRequest(language="python", code="print(1)"))
            episode = ep.start(next(iter(envs.get("lookup").generate("train", seed=i))), "b", 0, [],
                               temperature=1.0, top_p=1.0, call_format="plain")
            return episode

        base, _ = await rate(baseline, count, concurrency)
        print(f"baseline: one sandboxed print(1) a turn: {base:7.1f} episodes/s")
        print(f"{'environment':12s} {'episodes/s':>11s} {'turns':>6s} {'vs baseline':>12s} {'solved':>7s}")
        for name in envs.known():
            env = envs.get(name)
            tasks = env.generate("train", seed=11)
            chosen = [next(tasks) for _ in range(count)]
            solved = 0

            async def play(i, env=env, chosen=chosen):
                nonlocal solved
                episode = await ep.play(env, chosen[i], env.reference(chosen[i]), execute)
                solved += int(env.score(chosen[i], episode).passed)
                return episode

            per_s, turns = await rate(play, count, concurrency)
            print(f"{name:12s} {per_s:11.1f} {turns:6.1f} {per_s / base:11.2f}x {solved:4d}/{count}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    asyncio.run(main(args.episodes, args.concurrency))
