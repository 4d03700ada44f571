"""Step time and wall time to a held-out target: the five-service pipeline against a loop in one process.

    python bench/bench_pipeline.py [--steps 30] [--seeds 0] [--target 0.85] [--recipe recipes/digits.toml]

Same recipe, model, warm start, batch (groups_per_step x group_size), tokens and reward for both:
  - in-process: the project's own pieces with no bus and no services: the torch backend samples a
    step's tasks, the verifier's handler scores every completion, the aggregator's handler turns
    each group into trajectories with advantages, the learner's Trainer steps on them (the backend
    samples with the very model the trainer updates, so no weights are copied);
  - pipeline: `crucible train` (generator, sandbox, verifier, aggregator, learner, evaluator as
    processes over Kafka) with the recipe's max_policy_lag (sync at 0) and with lag 1 (async).
Both score the held-out split every `eval_every` (10) versions; the wall time to the target counts
from the first step and leaves out the in-process loop's own evaluations (the pipeline's evaluator
runs beside it). The pipeline's figures come from its report.json. TRL's GRPOTrainer (in a virtual
environment of its own) is not part of the bench yet.
Not a test: nothing gates on these numbers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from crucible.cli import recipe as recipes
from crucible.cli.train import format_only_examples
from crucible.ml import evaluation, task_sources
from crucible.ml.kinds import registry
from crucible.ml.policy.backends.torch_backend import TorchBackend
from crucible.ml.policy.checkpoint import fresh_policy, save_checkpoint
from crucible.ml.policy.sampling import SamplingParams
from crucible.ml.policy.sft import warm_start
from crucible.services.generator.handler import rollout_group
from crucible.services.learner.trainer import Trainer
from crucible.services.reward_aggregator.handler import RewardConfig, group_trajectories
from crucible.services.verifier import handler as verifier

ROOT = Path(__file__).resolve().parent.parent
EVAL_EVERY = 10


def initial_checkpoint(recipe: recipes.Recipe, seed: int, folder: Path) -> Path:
    """The recipe's built-in policy, warm-started on the answer format as `crucible train` does it."""
    model = fresh_policy(seed)
    warm_start(model, format_only_examples(recipe, seed), steps=recipe.model.warm_start_steps, batch_size=32,
               lr=3e-3, seed=seed)
    return save_checkpoint(model, folder / "init", {"version": 0})


def in_process(recipe: recipes.Recipe, seed: int, steps: int, target: float, folder: Path) -> dict:
    """The loop in one process; its step times and the wall time (evaluations left out) to the target."""
    config = recipe.run_config(run_id="bench").model_copy(update={"seed": seed})
    init = initial_checkpoint(recipe, seed, folder)
    backend = TorchBackend(init.as_uri(), seed=seed)
    trainer = Trainer(backend.model, config)  # one model: sampled from and trained
    train_tasks, heldout = task_sources.streams(
        recipe.tasks.sources, seed=seed, group_size=recipe.sampling.group_size,
        heldout_fraction=recipe.heldout.fraction, heldout_file=None, heldout_size=recipe.heldout.size,
        base=ROOT / "recipes")
    params = SamplingParams(temperature=config.temperature, top_p=config.top_p, max_tokens=config.max_tokens)
    rewards = RewardConfig.of(config)

    async def verify(request):
        return verifier.verify(request)

    def heldout_rate() -> float:
        return asyncio.run(evaluation.evaluate(backend, heldout, verify, max_tokens=config.max_tokens)).pass_rate

    before = heldout_rate()
    step_s, reached, working = [], None, 0.0
    for step in range(1, steps + 1):
        started = time.perf_counter()
        tasks = [next(train_tasks) for _ in range(config.groups_per_step)]
        completions = backend.sample([registry.render_prompt(t) for t in tasks], recipe.sampling.group_size, params)
        samples = []
        for i, (task, group) in enumerate(zip(tasks, completions)):
            message = rollout_group(task, f"s{step}-g{i}", group, params, policy_version=trainer.version,
                                    backend="torch", generator_id="bench", sample_ms=0.0)
            verdicts = [verifier.in_group(verifier.verify(r), message) for r in verifier.requests_for(message)]
            samples += group_trajectories(verdicts, rewards, complete=True)
        trainer.step(samples)
        step_s.append(time.perf_counter() - started)
        working += step_s[-1]
        if step % EVAL_EVERY == 0 and reached is None and heldout_rate() >= target:
            reached = working
    return {"step_s": statistics.median(step_s), "steps": steps, "heldout_before": before,
            "heldout_after": heldout_rate(), "to_target_s": reached}


def pipeline(recipe_path: Path, seed: int, steps: int, lag: int, target: float, folder: Path) -> dict:
    """`crucible train` on the recipe with this lag; figures from its report.json."""
    text = recipe_path.read_text()
    text = text.replace("max_policy_lag = 0", f"max_policy_lag = {lag}").replace(
        "eval_every = 20", f"eval_every = {EVAL_EVERY}")
    variant = folder / f"lag{lag}.toml"
    variant.write_text(text)
    out = subprocess.run([str(ROOT / "crucible"), "train", str(variant), "--steps", str(steps), "--seed", str(seed)],
                         capture_output=True, text=True, env=os.environ.copy(), timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"crucible train failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    checkpoint = next(line.split(":", 1)[1].strip() for line in out.stdout.splitlines()
                      if line.startswith("checkpoint "))
    report = json.loads((Path(checkpoint).parent.parent / "report.json").read_text())
    started = report["curve"][0]["t"] if report["curve"] else 0.0
    reached = next((e["t"] - started for e in report["evaluations"] if e["version"] > 0 and e["heldout"] >= target),
                   None)
    return {"step_s": report["seconds"] / max(report["steps"], 1), "steps": report["steps"],
            "heldout_before": report["heldout_before"], "heldout_after": report["heldout_after"],
            "to_target_s": reached, "breakdown": report.get("step_breakdown", {})}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--target", type=float, default=0.85, help="held-out pass rate to reach")
    parser.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "digits.toml")
    args = parser.parse_args()
    recipe = recipes.load(args.recipe)
    print(f"{args.recipe.name}: {recipe.algorithm.groups_per_step} tasks x {recipe.sampling.group_size} samples, "
          f"{recipe.sampling.max_tokens} tokens, {args.steps} steps, held-out target {args.target}; "
          f"{os.cpu_count()} cores")
    rows: dict[str, list[dict]] = {"in-process": [], "pipeline sync": [], "pipeline async (lag 1)": []}
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            rows["in-process"].append(in_process(recipe, seed, args.steps, args.target, folder))
            rows["pipeline sync"].append(pipeline(args.recipe, seed, args.steps, 0, args.target, folder))
            rows["pipeline async (lag 1)"].append(pipeline(args.recipe, seed, args.steps, 1, args.target, folder))
        for name, results in rows.items():
            r = results[-1]
            print(f"  seed {seed} {name:<24}: {r['step_s'] * 1000:6.0f} ms/step  held-out {r['heldout_before']:.3f}"
                  f" -> {r['heldout_after']:.3f}  to target "
                  f"{'%.1f s' % r['to_target_s'] if r['to_target_s'] is not None else 'not reached'}", flush=True)
    base = statistics.median(r["step_s"] for r in rows["in-process"])
    print("\nmedian over seeds           step time   vs in-process   reached target")
    for name, results in rows.items():
        s = statistics.median(r["step_s"] for r in results)
        reached = sum(r["to_target_s"] is not None for r in results)
        print(f"  {name:<24}: {s * 1000:6.0f} ms   {s / base:5.2f}x          {reached}/{len(results)} seeds")
    for r in rows["pipeline sync"][-1:]:
        if r["breakdown"]:
            print("  pipeline sync breakdown (median ms): "
                  + ", ".join(f"{k.removesuffix('_ms')} {v:.0f}" for k, v in r["breakdown"].items()))


if __name__ == "__main__":
    sys.exit(main())
