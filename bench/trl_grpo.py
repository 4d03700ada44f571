"""TRL's GRPOTrainer on a recipe's task stream, from the same warm-started checkpoint as the other runs.

    <trl venv>/bin/python bench/trl_grpo.py --init DIR --recipe R --seed S --steps N --target T --out FILE

Run by bench_pipeline.py inside a virtual environment of its own (TRL is never a dependency of the
project); that environment sees the project's packages, so the tasks, the reward and the held-out
evaluation are the very ones the in-process loop and the pipeline use:
  - tasks: the recipe's training stream for the seed, in order (TRL's shuffling off), each prompt
    rendered by its kind and sampled group_size times;
  - reward: the verifier's handler on each completion (the scalar the aggregator uses by default);
  - held-out: TRL's model weights copied into the project's torch backend, then the evaluator's
    greedy pass rate, every `--eval-every` steps, its time left out of the wall time to the target.
Hyperparameters follow the recipe: lr and its schedule (AdamW stepped on the learner's own
`scheduled_lr`), KL coefficient (on TRL's k3 penalty; ours is d^2/2 of the log-ratio, see
ml/policy/losses.py), clip epsilon, grad-norm clip, temperature, top_p, tokens, token-mean loss over the batch (TRL's "dapo", our masked mean), mean-centred advantages for
rloo/reinforce (scale_rewards "none") and std-scaled for grpo. Writes {"step_s", "steps", "heldout_before", "heldout_after", "to_target_s"} to --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from crucible.cli import recipe as recipes
from crucible.ml import evaluation, task_sources
from crucible.ml.kinds import registry
from crucible.ml.policy import hf
from crucible.ml.policy.backends import backend_for
from crucible.ml.policy.model import causal_mask
from crucible.v1 import rollout_pb2, verdict_pb2
from crucible.services.learner.trainer import scheduled_lr
from crucible.services.verifier import handler as verifier
from crucible.shared.settings import Settings

ROOT = Path(__file__).resolve().parent.parent


def render_for(tokenizer, backend, prompt: str) -> str:
    """The text TRL's tokenizer call turns into the very ids `backend` samples `prompt` from."""
    ids = backend.encode(prompt)
    for text in (tokenizer.decode(ids), tokenizer.decode(ids, skip_special_tokens=True)):
        if tokenizer(text)["input_ids"] == ids:
            return text
    raise SystemExit(f"no text makes TRL's tokenizer give the prompt ids our backend uses for {prompt!r}")


def reward_of(task, text: str) -> float:
    request = verdict_pb2.VerifyRequest(task=task, rollout=rollout_pb2.Rollout(id=f"trl/{task.id}", completion=text))
    return verifier.verify(request).reward


class Clock(TrainerCallback):
    """Step times, and the held-out pass rate every `every` steps with its time left out."""

    def __init__(self, heldout_rate, every: int, target: float):
        self.heldout_rate, self.every, self.target = heldout_rate, every, target
        self.step_s: list[float] = []
        self.working = 0.0
        self.reached: float | None = None
        self._started = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_s.append(time.perf_counter() - self._started)
        self.working += self.step_s[-1]
        if state.global_step % self.every == 0 and self.reached is None and self.heldout_rate() >= self.target:
            self.reached = self.working
        print(f"trl step {state.global_step}: {self.step_s[-1] * 1000:.0f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--init", type=Path, required=True)
    parser.add_argument("--recipe", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    recipe = recipes.load(args.recipe)
    config = recipe.run_config(run_id="bench-trl").model_copy(update={"seed": args.seed})
    train_tasks, heldout = task_sources.streams(
        recipe.tasks.sources, seed=args.seed, group_size=recipe.sampling.group_size,
        heldout_fraction=recipe.heldout.fraction, heldout_file=None, heldout_size=recipe.heldout.size,
        base=ROOT / "recipes")
    tasks = [next(train_tasks) for _ in range(args.steps * config.groups_per_step)]

    torch.manual_seed(args.seed)
    backend = backend_for(Settings(seed=args.seed, chat_template=recipe.model.chat_template,
                                   system_prompt=recipe.model.system_prompt), args.init.as_uri())
    model = AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.init)
    # TRL stops at the tokenizer's EOS as well as the generation config's: make it the one our
    # backends stop at (a converted tokenizer may name another), and pad with it where there is no pad.
    eos = sorted(hf.eos_ids(model, tokenizer))
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos[0])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # TRL tokenizes a plain-text prompt with the tokenizer's special tokens: give it the text whose ids
    # are exactly the ones our backend samples from (a chat template rendered, or BOS as our tokenizer adds it).
    prompts = [render_for(tokenizer, backend, registry.render_prompt(t)) for t in tasks]

    if hf.is_builtin(args.init):
        probe = torch.tensor([backend.encode(registry.render_prompt(tasks[0]))])
        with torch.no_grad():
            theirs = model(probe).logits
            mine = backend.model(probe, torch.arange(probe.shape[1])[None],
                                 causal_mask(torch.ones_like(probe), probe.shape[1]))
        if not torch.allclose(theirs, mine, atol=1e-4):
            raise SystemExit(f"transformers' Llama and the built-in policy disagree on the same weights "
                             f"(max |diff| {(theirs - mine).abs().max():.2e})")

    async def verify(request):
        return verifier.verify(request)

    def heldout_rate() -> float:
        missing, unexpected = backend.model.load_state_dict(model.state_dict(), strict=False)
        if missing or unexpected:
            raise SystemExit(f"weights do not map onto the policy: missing {missing}, unexpected {unexpected}")
        return asyncio.run(evaluation.evaluate(backend, heldout, verify, max_tokens=config.max_tokens)).pass_rate

    by_prompt_index = dict(enumerate(tasks))

    def reward(prompts, completions, index, **_):
        return [reward_of(by_prompt_index[i], text) for i, text in zip(index, completions)]

    n = recipe.sampling.group_size
    batch = config.groups_per_step * n
    micro = config.micro_batch_size if config.micro_batch_size and batch % config.micro_batch_size == 0 else batch
    with tempfile.TemporaryDirectory() as out:
        trl_config = GRPOConfig(
            output_dir=out, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
            use_cpu=True, bf16=False, seed=args.seed, data_seed=args.seed, shuffle_dataset=False,
            max_steps=args.steps, num_generations=n, num_iterations=config.epochs,
            # one optimiser step per step's batch, in micro-batches as the recipe says
            per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
            gradient_checkpointing=config.gradient_checkpointing,
            max_completion_length=config.max_tokens, temperature=config.temperature, top_p=config.top_p,
            learning_rate=config.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            max_grad_norm=config.max_grad_norm, beta=config.kl_coef, epsilon=config.clip_eps, loss_type="dapo",
            scale_rewards="group" if config.estimator == "grpo" else "none",
        )
        dataset = Dataset.from_dict({"prompt": prompts, "index": list(range(len(prompts)))})
        before = heldout_rate()
        clock = Clock(heldout_rate, args.eval_every, args.target)
        # AdamW as the learner makes it, stepped on the learner's schedule.
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: scheduled_lr(config, step) / config.lr)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=trl_config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[clock], optimizers=(optimizer, schedule))
        trainer.train()
        # TRL took the steps on the learner's schedule (its trainer steps the scheduler after each).
        taken = optimizer.state_dict()["state"][0]["step"]
        assert schedule.get_last_lr()[0] == scheduled_lr(config, int(taken)), (schedule.get_last_lr(), taken)
    result = {"step_s": statistics.median(clock.step_s), "steps": len(clock.step_s), "heldout_before": before,
              "heldout_after": heldout_rate(), "to_target_s": clock.reached}
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
