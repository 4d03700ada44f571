"""Step time and wall time to a held-out target: the five-service pipeline, a loop in one process, and TRL.

    python bench/bench_pipeline.py [--steps 30] [--seeds 0] [--target 0.85] [--recipe recipes/digits.toml]
                                   [--runs in-process in-process-lag1 sync async trl]

Same recipe, model, warm start, batch (groups_per_step x group_size), tokens and reward for both:
  - in-process: the project's own pieces with no bus and no services: the torch backend samples a
    step's tasks, the verifier's handler scores every completion, the aggregator's handler turns
    each group into trajectories with advantages, the learner's Trainer steps on them (the backend
    samples with the very model the trainer updates, so no weights are copied);
  - in-process-lag1: the same loop one version behind, as the pipeline's async mode trains: each
    step's batch is sampled with the weights from before the previous step (a second copy of the
    model, loaded after every step). It tells what asynchrony does to learning apart from what the
    services and the bus do (in one process, a seed runs in about 20 s here, a third of a pipeline run;
    its step also copies the weights into the second model: compare its learning, not its step time);
  - pipeline: `crucible train` (generator, sandbox, verifier, aggregator, learner, evaluator as
    processes over Kafka) at max_policy_lag 0 (sync) and 1 (async), whatever the recipe says.
Both score the held-out split every `eval_every` (10) versions, greedy answers only (the recipe's
eval_samples is set to 0 for the pipeline: the loop draws no sampled ones); the wall time to the target counts
from the first step to the one that produced the first version scoring it, evaluations left out (the
pipeline's: the time that version was published, not when its evaluator, running beside it, finished). The pipeline's figures come from its report.json. A step time is a median in every
setting: of the loop's steps, of the time between the pipeline's consecutive versions (those no
evaluation overlapped, as the loop's steps hold none; the median of all of them is printed beside),
of TRL's steps.
  - trl: TRL's GRPOTrainer (bench/trl_grpo.py) from the same starting checkpoint on the same task
    stream, reward, batch, tokens and hyperparameters, in a virtual environment of its own that
    the bench makes once under CRUCIBLE_HOME (TRL is never a dependency of the project); the
    held-out rate is our evaluator's on its weights.
Any recipe: `--recipe recipes/smollm2-arithmetic.toml` runs SmolLM2-135M (`crucible models add
smollm2-135m` once) in every setting.
Not a test: nothing gates on these numbers.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from crucible.cli import recipe as recipes
from crucible.cli.train import warm_started_policy
from crucible.ml import evaluation, models, task_sources
from crucible.ml.kinds import registry
from crucible.ml.policy.backends import backend_for
from crucible.ml.policy.checkpoint import save_checkpoint
from crucible.ml.policy.sampling import SamplingParams
from crucible.services.generator.handler import rollout_group
from crucible.services.learner.groups import informative
from crucible.services.learner.trainer import Trainer
from crucible.services.reward_aggregator.handler import RewardConfig, group_trajectories
from crucible.services.sandbox_executor.isolation import base_python
from crucible.services.verifier import handler as verifier
from crucible.shared.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
EVAL_EVERY = 10
TRL_VERSION = "1.16.0"
# The project's packages TRL uses or would otherwise upgrade: the TRL environment keeps the project's versions.
SHARED_WITH_TRL = ("torch", "transformers", "accelerate", "tokenizers", "safetensors", "huggingface-hub", "numpy",
                   "click", "protobuf")
RUNS = {"in-process": "in-process", "in-process-lag1": "in-process (lag 1)", "sync": "pipeline sync", "async": "pipeline async (lag 1)", "trl": "TRL GRPOTrainer"}


def initial_checkpoint(recipe: recipes.Recipe, seed: int, folder: Path) -> Path:
    """The recipe's model as `crucible train` starts it: a Hugging Face model's folder as it is, or the
    built-in policy warm-started on the answer format."""
    if recipe.model.name != "builtin":
        return models.resolve(recipe.model.name, Settings())
    model, _ = warm_started_policy(recipe, seed)
    return save_checkpoint(model, folder / "init", {"version": 0})


def in_process(recipe: recipes.Recipe, seed: int, steps: int, target: float, folder: Path, lag: int = 0) -> dict:
    """The loop in one process; its step times and the wall time (evaluations left out) to the target.
    With `lag` 1, every batch is sampled with the weights one version older than those it trains."""
    config = recipe.run_config(run_id="bench").model_copy(update={"seed": seed})
    if lag and 0 <= config.max_policy_lag < lag:  # its batches would all be dropped as stale
        config = config.model_copy(update={"max_policy_lag": lag})
    init = initial_checkpoint(recipe, seed, folder)
    settings = Settings(seed=seed, chat_template=recipe.model.chat_template, system_prompt=recipe.model.system_prompt)
    backend = backend_for(settings, init.as_uri())
    trainer = Trainer(backend.model, config)  # one model: sampled from and trained (lag 0)
    sampler = backend_for(settings, init.as_uri()) if lag else backend  # lag 1: the weights a version behind
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

    def sampled_groups(step: int, count: int) -> list[list]:
        """`count` new tasks sampled, scored and turned into trajectories with advantages, by group."""
        tasks = [next(train_tasks) for _ in range(count)]
        completions = sampler.sample([registry.render_prompt(t) for t in tasks], recipe.sampling.group_size, params)
        groups = []
        for task, group in zip(tasks, completions):
            message = rollout_group(task, f"s{step}-g{next(group_ids)}", group, params,
                                    policy_version=max(trainer.version - lag, 0),
                                    backend=sampler.name, generator_id="bench", sample_ms=0.0)
            verdicts = [verifier.in_group(verifier.verify(r), message) for r in verifier.requests_for(message)]
            groups.append(group_trajectories(verdicts, rewards, complete=True))
        return groups

    def batch(step: int) -> tuple[list, frozenset]:
        """A step's samples and the groups dynamic sampling filtered, as the learner chooses them: each
        filtered group is replaced by a new task (as `crucible train` does) until groups_per_step
        informative ones are in, or dynamic_sampling_window times that many were drawn (then the
        informative ones there are; none: groups_per_step uninformative ones)."""
        per_step = config.groups_per_step
        if not config.dynamic_sampling:
            return [s for g in sampled_groups(step, per_step) for s in g], frozenset()
        useful, flat, drawn = [], [], 0
        while len(useful) < per_step and drawn < config.dynamic_sampling_window * per_step:
            count = min(per_step - len(useful), config.dynamic_sampling_window * per_step - drawn)
            for group in sampled_groups(step, count):
                (useful if informative(group) else flat).append(group)
            drawn += count
        if not useful:
            useful, flat = flat[:per_step], flat[per_step:]
        return [s for g in useful + flat for s in g], frozenset(g[0].group_id for g in flat)

    group_ids = itertools.count()
    before = heldout_rate()
    step_s, reached, working, cpu_s = [], None, 0.0, 0.0
    for step in range(1, steps + 1):
        started, cpu_started = time.perf_counter(), process_cpu_s()
        start_weights = {k: v.clone() for k, v in trainer.model.state_dict().items()} if lag else None
        trainer.step(*batch(step))
        if lag:  # the next batch is drawn with the weights this step started from
            sampler.model.load_state_dict(start_weights)
        step_s.append(time.perf_counter() - started)
        cpu_s += process_cpu_s() - cpu_started
        working += step_s[-1]
        if step % EVAL_EVERY == 0 and reached is None and heldout_rate() >= target:
            reached = working
    return {"step_s": statistics.median(step_s), "steps": steps, "heldout_before": before,
            "heldout_after": heldout_rate(), "to_target_s": reached,
            "cpu_ms_per_step": {"in-process loop": cpu_s * 1000 / steps}}


def process_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def with_setting(text: str, section: str, key: str, value) -> str:
    """The recipe's TOML text with `key = value` in `[section]`, replaced where it is set."""
    line = f"{key} = {value}"
    pattern = re.compile(rf"^{key}\s*=.*$", re.M)
    if pattern.search(text):
        return pattern.sub(line, text, count=1)
    if f"[{section}]" in text:
        return text.replace(f"[{section}]", f"[{section}]\n{line}", 1)
    return f"{text}\n[{section}]\n{line}\n"


def pipeline(recipe_path: Path, seed: int, steps: int, lag: int, target: float, folder: Path) -> dict:
    """`crucible train` on the recipe with this lag; figures from its report.json."""
    text = with_setting(recipe_path.read_text(), "algorithm", "max_policy_lag", lag)
    # The loop's evaluation: greedy answers to the held-out tasks every EVAL_EVERY versions, no sampled
    # ones (the recipe's eval_samples would have the generator draw them beside the training).
    text = with_setting(with_setting(text, "eval", "eval_every", EVAL_EVERY), "eval", "eval_samples", 0)
    variant = folder / f"lag{lag}.toml"
    variant.write_text(text)
    out = subprocess.run([str(ROOT / "crucible"), "train", str(variant), "--steps", str(steps), "--seed", str(seed)],
                         capture_output=True, text=True, env=os.environ.copy(), timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"crucible train failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    checkpoint = next(line.split(":", 1)[1].strip() for line in out.stdout.splitlines()
                      if line.startswith("checkpoint "))
    report = json.loads((Path(checkpoint).parent.parent / "report.json").read_text())
    # Reached when the version that first scored the target was published (its curve time, counted from
    # the first task fed), as the loop and TRL count their working time up to the step they evaluate:
    # not when the evaluator, running beside the training, finished scoring it.
    published = {point["version"]: point["t"] for point in report["curve"]}
    reached = next((published[e["version"]] for e in report["evaluations"]
                    if e["version"] in published and e["heldout"] >= target), None)
    if reached is None and report["curve"] and report["heldout_after"] >= target:
        # The evaluator had not scored the last version when the run stopped; `crucible train` scored it
        # after the last step, as the in-process loop scores its last step: reached at that step.
        reached = report["curve"][-1]["t"]
    # The median time between consecutive versions, as the in-process loop's step is its median: start-up
    # (services, the first batch) and the final evaluation are in neither. The loop leaves its evaluations
    # out of its steps; the evaluator runs beside the pipeline's, on the same two cores, so the intervals
    # an evaluation overlapped are left out here (all of them: `step_s_all`).
    times = [point["t"] for point in report["curve"]]
    intervals = [(a, b) for a, b in zip(times, times[1:])]
    evaluating = [(e["t"] - e["eval_ms"] / 1000, e["t"]) for e in report["evaluations"]]
    clear = [b - a for a, b in intervals if not any(start < b and a < end for start, end in evaluating)]
    every = [b - a for a, b in intervals]
    step_s_all = statistics.median(every) if every else report["seconds"] / max(report["steps"], 1)
    step_s = statistics.median(clear) if len(clear) >= len(every) // 2 and clear else step_s_all
    return {"step_s": step_s, "step_s_all": step_s_all, "steps": report["steps"],
            "heldout_before": report["heldout_before"], "heldout_after": report["heldout_after"],
            "to_target_s": reached, "breakdown": report.get("step_breakdown", {}),
            "cpu_ms_per_step": report.get("cpu_ms_per_step", {})}


def trl_python() -> Path:
    """The interpreter of the bench's TRL environment, made once under CRUCIBLE_HOME: TRL and what it
    needs beyond the project's own packages, which it sees (the same torch and transformers)."""
    venv = Settings().home / "bench" / f"trl-{TRL_VERSION}"
    python = venv / "bin" / "python"
    if (venv / "ready").exists():
        return python
    print(f"making TRL {TRL_VERSION}'s environment in {venv} (once)", flush=True)
    subprocess.run([base_python(), "-m", "venv", "--clear", str(venv)], check=True)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    # A site directory (not a plain path), so that the project's own .pth files (its editable install) apply.
    Path(site, "crucible-project.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    # Pinned to what the project has, so TRL runs on the very torch and transformers the other settings use.
    pins = venv / "constraints.txt"
    pins.write_text("".join(f"{name}=={importlib.metadata.version(name)}\n" for name in SHARED_WITH_TRL))
    # pip warns that the project's own fsspec pin differs from the one datasets takes here: only this
    # environment has that fsspec, so its output is shown only when the install fails.
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c", str(pins),
                           f"trl=={TRL_VERSION}"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"installing TRL {TRL_VERSION} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    (venv / "ready").touch()
    return python


def trl(recipe_path: Path, recipe: recipes.Recipe, seed: int, steps: int, target: float, folder: Path) -> dict:
    """TRL's GRPOTrainer on the same work from the same starting checkpoint (bench/trl_grpo.py)."""
    init = initial_checkpoint(recipe, seed, folder)
    out = folder / "trl.json"
    env = {**os.environ, "PYTHONPYCACHEPREFIX": os.environ.get("PYTHONPYCACHEPREFIX",
                                                                str(Settings().home / "pycache"))}
    done = subprocess.run([str(trl_python()), str(ROOT / "bench" / "trl_grpo.py"), "--init", str(init),
                           "--recipe", str(recipe_path), "--seed", str(seed), "--steps", str(steps),
                           "--target", str(target), "--eval-every", str(EVAL_EVERY), "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"TRL failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def _time_key(result: dict) -> tuple[bool, float]:
    """Orders runs by wall time to the target, every run that missed it after every run that reached it."""
    return result["to_target_s"] is None, result["to_target_s"] or 0.0


def median_to_target(results: list[dict]) -> float | None:
    """The median wall time to the target over every seed, a seed that missed it counting as slower than any
    that reached it (a median over the seeds that reached it alone would drop the slowest); None where the
    median falls on a miss."""
    ordered = sorted(results, key=_time_key)
    middle = ordered[(len(ordered) - 1) // 2], ordered[len(ordered) // 2]
    if any(r["to_target_s"] is None for r in middle):
        return None
    return (middle[0]["to_target_s"] + middle[1]["to_target_s"]) / 2


def faster_than(results: list[dict], others: list[dict]) -> int:
    """On how many seeds (the same seeds, in the same order) a run reached the target sooner than the other's."""
    return sum(_time_key(a) < _time_key(b) for a, b in zip(results, others, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--target", type=float, default=0.85, help="held-out pass rate to reach")
    parser.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "digits.toml")
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS), help="which settings to run")
    args = parser.parse_args()
    recipe = recipes.load(args.recipe)
    print(f"{args.recipe.name}: {recipe.algorithm.groups_per_step} tasks x {recipe.sampling.group_size} samples, "
          f"{recipe.sampling.max_tokens} tokens, {args.steps} steps, held-out target {args.target}; "
          f"{os.cpu_count()} cores")
    rows: dict[str, list[dict]] = {RUNS[run]: [] for run in args.runs}
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            for run in args.runs:
                if run in ("in-process", "in-process-lag1"):
                    result = in_process(recipe, seed, args.steps, args.target, folder, lag=int(run == "in-process-lag1"))
                elif run == "trl":
                    result = trl(args.recipe, recipe, seed, args.steps, args.target, folder)
                else:
                    result = pipeline(args.recipe, seed, args.steps, int(run == "async"), args.target, folder)
                rows[RUNS[run]].append(result)
                # each run's line as soon as it ends: a sweep of several seeds takes the better part of an hour
                beside = f" ({result['step_s_all'] * 1000:.0f} with evaluations)" if "step_s_all" in result else ""
                print(f"  seed {seed} {RUNS[run]:<24}: {result['step_s'] * 1000:6.0f} ms/step{beside}  held-out "
                      f"{result['heldout_before']:.3f} -> {result['heldout_after']:.3f}  to target "
                      f"{'%.1f s' % result['to_target_s'] if result['to_target_s'] is not None else 'not reached'}",
                      flush=True)
    baseline = next(iter(rows))
    base = statistics.median(r["step_s"] for r in rows[baseline])
    print(f"\nmedian over seeds           step time   vs {baseline:<14} reached target   time to target"
          f"{'   faster than TRL' if RUNS['trl'] in rows and len(rows) > 1 else ''}")
    for name, results in rows.items():
        s = statistics.median(r["step_s"] for r in results)
        reached = sum(r["to_target_s"] is not None for r in results)
        to_target = median_to_target(results)
        line = (f"  {name:<24}: {s * 1000:6.0f} ms   {s / base:5.2f}x             {reached}/{len(results)} seeds"
                f"      {'%.1f s' % to_target if to_target is not None else 'not reached'}")
        if RUNS["trl"] in rows and name != RUNS["trl"]:
            line += f"      on {faster_than(results, rows[RUNS['trl']])}/{len(results)} seeds"
        print(line)
    for name in ("in-process", "in-process (lag 1)", "pipeline sync", "pipeline async (lag 1)"):
        for r in rows.get(name, [])[-1:]:
            if r.get("breakdown"):
                print(f"  {name} breakdown (median ms): "
                      + ", ".join(f"{k.removesuffix('_ms')} {v:.0f}" for k, v in r["breakdown"].items()))
            if r.get("cpu_ms_per_step"):
                print(f"  {name} CPU per step (ms): "
                      + ", ".join(f"{k} {v:.0f}" for k, v in r["cpu_ms_per_step"].items() if v >= 1)
                      + f"; total {sum(r['cpu_ms_per_step'].values()):.0f}")


if __name__ == "__main__":
    sys.exit(main())
