"""The learner's step time on 1 against N ranks (torch.distributed under torchrun, on this machine).

    python bench/bench_learner_ranks.py [--model builtin|smollm2-135m|FOLDER] [--ranks 1 2]
                                        [--groups 16] [--group-size 8] [--prompt 16] [--tokens 8] [--steps 6]
                                        [--sharding ddp|fsdp]

For each rank count it starts torchrun with that many processes; every rank builds the Trainer on
the same weights, rank 0 hands each batch to the others exactly as the learner service does
(Trainer.step then checkpoint_state, the collective part of a checkpoint), and rank 0 reports the
median step time after one warm-up step. The batch is the built-in recipe's shape by default
(16 groups of 8 samples, each group's sharing a prompt, 8 completion tokens). Every rank runs one thread (torchrun's default), so
on a machine of C cores, 1 rank uses 1 core and C ranks use C: the ratio is what sharding the batch
buys, communication included. The 1-rank figure is also given with all cores' threads, the
learner's single-process default. Not a test: nothing gates on these numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def batch(args, vocab: int):
    import random

    from crucible.v1 import trajectory_pb2

    rng = random.Random(0)
    samples = []
    for g in range(args.groups):
        prompt = [rng.randrange(1, vocab) for _ in range(args.prompt)]  # a group's samples share their task's
        for i in range(args.group_size):
            reward = float(rng.random() < 0.5)
            samples.append(trajectory_pb2.Trajectory(
                id=f"g{g}/{i}", group_id=f"g{g}", sample_index=i, group_size=args.group_size,
                group_received=args.group_size, policy_version=0,
                prompt_token_ids=prompt,
                completion_token_ids=[rng.randrange(1, vocab) for _ in range(args.tokens)],
                logprobs=[-5.0] * args.tokens, temperature=1.0, top_p=1.0, reward=reward, advantage=reward - 0.5))
    return samples


def rank_main(args) -> None:
    """One rank of the measured learner (under torchrun)."""
    import torch

    from crucible.ml.models import resolve
    from crucible.ml.policy.checkpoint import fresh_policy, load_checkpoint
    from crucible.services.learner.ranks import Ranks
    from crucible.services.learner.trainer import Trainer
    from crucible.shared.settings import RunConfig, Settings

    ranks = Ranks.from_env(args.sharding)
    if args.model == "builtin":
        model = fresh_policy(0)
    else:
        model, _ = load_checkpoint(resolve(args.model, Settings()))
    vocab = int(getattr(model.config, "vocab_size", 256))
    trainer = Trainer(model, RunConfig(lr=1e-5, kl_coef=0.05, micro_batch_size=args.micro_batch, max_policy_lag=-1), ranks=ranks)
    if not ranks.main:
        trainer.follow(trainer.checkpoint_state)
        ranks.close()
        return
    samples = batch(args, vocab)
    times = []
    for _ in range(args.steps + 1):
        began = time.perf_counter()
        trainer.step(samples)
        trainer.checkpoint_state()
        times.append((time.perf_counter() - began) * 1000)
    trainer.release()
    Path(args.out).write_text(json.dumps({"ranks": ranks.world, "threads": torch.get_num_threads(),
                                          "step_ms": statistics.median(times[1:])}))
    ranks.close()


def measure(args, ranks: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="crucible-bench-ranks-") as tmp:
        out = Path(tmp) / "result.json"
        own = [a for a in sys.argv[1:] if a != "--rank-main"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               str(Path(__file__).resolve()), "--rank-main", "--out", str(out), *own]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{ranks} ranks failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--sharding", default="ddp", choices=["ddp", "fsdp"])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=0)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args)
        return
    cores = os.cpu_count() or 1
    print(f"model {args.model}, {args.groups}x{args.group_size} samples of {args.prompt}+{args.tokens} tokens, "
          f"{args.sharding}, median of {args.steps} steps (step + checkpoint gather)")
    base = measure(args, 1, 1)
    print(f"  1 rank,  1 thread : {base['step_ms']:8.1f} ms/step")
    if cores > 1:
        wide = measure(args, 1, cores)
        print(f"  1 rank, {cores} threads: {wide['step_ms']:8.1f} ms/step  ({base['step_ms'] / wide['step_ms']:.2f}x)")
    for n in args.ranks:
        if n == 1:
            continue
        got = measure(args, n, 1)
        print(f"  {n} ranks, 1 thread each: {got['step_ms']:8.1f} ms/step  ({base['step_ms'] / got['step_ms']:.2f}x "
              f"against 1 rank, 1 thread)")


if __name__ == "__main__":
    main()
