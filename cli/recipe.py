"""Recipes: a whole training job in one TOML file.

    [model]      name = "builtin" | a name from `crucible models list` | a folder; chat_template, system_prompt
    [[tasks.sources]]  family = "digits"|"arithmetic" | environment = "lookup"|"sql"|"python"|"logs"|"events"
                       | jsonl = "file.jsonl" | set = "humaneval"|"math" | reasoning_gym = "gcd"
    [heldout]    file = "..." or fraction = 0.2 (a stable hash split), size
    [sampling]   group_size, max_tokens (per turn), max_episode_tokens, temperature, top_p
    [algorithm]  objective, estimator, lr, kl_coef, groups_per_step, max_policy_lag, ...
    [budget]     steps and/or minutes
    [eval]       eval_every, eval_samples

Every field has one default, in one place: what the services read is RunConfig's
(shared/settings.py; `SECTIONS` below says which recipe section holds each), what only
`crucible train` reads is declared here. An unknown or mistyped field is an error naming
the field, the file and the line.
"""
from __future__ import annotations

import math
import re
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from crucible.shared import files
from crucible.shared.settings import RunConfig

# Which section of a recipe holds each RunConfig field (run_id and init_checkpoint are set by the job).
SECTIONS: dict[str, tuple[str, ...]] = {
    "model": ("chat_template", "system_prompt"),
    "sampling": ("temperature", "top_p", "max_tokens", "max_episode_tokens"),
    "eval": ("eval_every", "eval_samples"),
    "learner": ("learner_ranks", "learner_sharding", "learner_optimizer_every"),
    "algorithm": ("seed", "objective", "estimator", "lr", "lr_decay_steps", "lr_warmup_steps", "epochs", "clip_eps", "kl_coef",
                  "entropy_coef", "max_grad_norm", "dpo_beta", "groups_per_step", "max_policy_lag",
                  "dynamic_sampling", "dynamic_sampling_window", "micro_batch_size", "gradient_checkpointing", "lora_rank", "lora_alpha", "reward_weights",
                  "length_penalty",
                  "length_target", "group_timeout_s"),
}
SET_BY_THE_JOB = ("run_id", "init_checkpoint")

STRICT = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
# No count, size, seed or limit of a recipe means anything past this, and a seed past int64 failed inside
# the services after the stack had started ("Overflow when unpacking long long").
MAX_INTEGER = 2 ** 53


class RecipeError(ValueError):
    """A recipe that cannot run; the text names the file, the line and the field."""


def _section(section: str, **own: Any) -> type[BaseModel]:
    """A section model: its RunConfig fields (with RunConfig's defaults) plus its own (defaults here)."""
    fields = {f: (RunConfig.model_fields[f].annotation, RunConfig.model_fields[f]) for f in SECTIONS.get(section, ())}
    return create_model(f"{section.title()}Section", __config__=STRICT, **fields, **own)


# The fields of a task source beyond its kind, and the kinds of source each applies to.
_SOURCE_FIELDS = {"ops": ("family",), "grader": ("family",), "canaries": ("family",),
                  "config": ("reasoning_gym",), "count": ("set", "reasoning_gym")}


class TaskSource(BaseModel):
    """One source of training tasks; exactly one of family, environment, jsonl, set, reasoning_gym."""

    model_config = STRICT
    family: str | None = Field(default=None, description="A built-in procedural family: digits, arithmetic.")
    ops: list[str] | None = Field(default=None, description="The family's ops (digits: parity, size, ...; "
                                  "arithmetic: + and -); default: the family's own.")
    environment: str | None = Field(default=None, description="A built-in multi-turn environment's procedural "
                                    "tasks: lookup, sql, python, logs, events (held out: the environment's own split).")
    jsonl: str | None = Field(default=None, description="A file of Task JSON, one per line (relative to the recipe).")
    set: str | None = Field(default=None, description="A built-in set: humaneval, math.")
    reasoning_gym: str | None = Field(default=None, description="A reasoning-gym generator name.")
    config: dict[str, Any] = Field(default_factory=dict, description="The reasoning-gym generator's config.")
    count: int | None = Field(default=None, ge=1, description="How many tasks to take (sets and generators).")
    grader: str | None = Field(default=None, description="Families only: the task kind that grades the training "
                               "tasks instead of the family's own (held-out tasks keep the family's own); "
                               "`lenient_exact` is the planted weak grader of recipes/planted-hack.toml.")
    canaries: float = Field(default=0.0, ge=0.0, le=0.5, description="Families only: this share of the training "
                            "tasks are canaries, which no honest answer passes (a paid canary raises an alert).")

    @model_validator(mode="after")
    def one_kind(self):
        chosen = [k for k in ("family", "environment", "jsonl", "set", "reasoning_gym") if getattr(self, k) is not None]
        if len(chosen) != 1:
            raise ValueError("give exactly one of family, environment, jsonl, set, reasoning_gym"
                             + (f" (got {', '.join(chosen)})" if chosen else ""))
        # Each field applies to the kinds of source it names; given to another, it would do nothing.
        kind = chosen[0]
        # (a field at its default does nothing anywhere: a saved run's recipe writes every one)
        misplaced = [field for field, kinds_ in _SOURCE_FIELDS.items() if kind not in kinds_
                     and getattr(self, field) != type(self).model_fields[field].get_default(call_default_factory=True)]
        if misplaced:
            raise ValueError(f"{', '.join(misplaced)} cannot apply to {'an' if kind[0] in 'aeiou' else 'a'} {kind} "
                             "source (it would do nothing): "
                             + "; ".join(f"{f} is for {' and '.join(_SOURCE_FIELDS[f])} sources" for f in misplaced))
        if self.grader is not None:
            from crucible.ml import kinds

            if self.grader not in kinds.known():
                raise ValueError(f"unknown grader {self.grader!r}: task kinds are {sorted(kinds.known())}")
        return self


ModelSection = _section("model", name=(str, Field(default="builtin", description="builtin, a registered model "
                                                     "name, or a folder holding a Hugging Face causal LM.")),
                        warm_start_steps=(int, Field(default=100, ge=0, description="The built-in policy only: "
                                                     "steps that teach it the answer format first (digits; "
                                                     "environments with a format, e.g. lookup's calls).")),
                        init_scale=(float, Field(default=0.02, gt=0, le=1, description="The built-in policy only: the "
                                                 "standard deviation its fresh weights are drawn with.")))
SamplingSection = _section("sampling", group_size=(int, Field(default=8, ge=1, description="Samples per task.")))
AlgorithmSection = _section("algorithm")


class TasksSection(BaseModel):
    model_config = STRICT
    sources: list[TaskSource] = Field(default_factory=lambda: [TaskSource(family="digits")], min_length=1)


class HeldoutSection(BaseModel):
    model_config = STRICT
    file: str | None = Field(default=None, description="Held-out tasks from their own JSONL file.")
    fraction: float = Field(default=0.2, ge=0.0, lt=1.0, description="Otherwise: this share of the tasks, "
                            "chosen by a stable hash of the task id (the same tasks every run).")
    size: int = Field(default=200, ge=1, description="At most this many held-out tasks are scored.")


class BudgetSection(BaseModel):
    model_config = STRICT
    steps: int = Field(default=80, ge=1)
    minutes: float = Field(default=15.0, gt=0)


EvalSection = _section("eval")
LearnerSection = _section("learner")


class Recipe(BaseModel):
    model_config = STRICT
    model: ModelSection = Field(default_factory=ModelSection)
    tasks: TasksSection = Field(default_factory=TasksSection)
    heldout: HeldoutSection = Field(default_factory=HeldoutSection)
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    budget: BudgetSection = Field(default_factory=BudgetSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    learner: LearnerSection = Field(default_factory=LearnerSection)
    source: Path | None = Field(default=None, exclude=True, description="The file it came from, if any.")

    def run_config(self, **job: Any) -> RunConfig:
        """The services' part of the recipe, plus what the job sets (run_id, init_checkpoint)."""
        values = {f: getattr(getattr(self, section), f) for section, names in SECTIONS.items() for f in names}
        return RunConfig(**values, **job)

    def path(self, relative: str) -> Path:
        """A path the recipe names, relative to the recipe's own folder."""
        p = Path(relative).expanduser()
        return p if p.is_absolute() or self.source is None else self.source.parent / p


def load(path: str | Path) -> Recipe:
    """The recipe in `path`; RecipeError naming the file, line and field for anything wrong in it."""
    path = Path(path)
    try:
        text = files.read_text(path)
    except files.Unreadable as exc:
        raise RecipeError(f"cannot read recipe {path}: {exc}") from None
    return parse(text, path)


def parse(text: str, path: Path) -> Recipe:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{path}: not valid TOML: {exc}") from None
    try:
        recipe = Recipe.model_validate(data)
        # what the fields were read as: a quoted "1e20" or a float 1e18 becomes an int past the bound
        found = list(_outsized(recipe.model_dump(exclude={"source"})))
    except ValidationError as exc:
        found = [([str(p) for p in error["loc"]], "unknown field" if error["type"] == "extra_forbidden" else error["msg"])
                 for error in exc.errors()]
    if found:
        problems = []
        for loc, what in found:
            line = find_line(text, loc)
            where = f"{path}:{line}" if line else str(path)
            problems.append(f"{where}: {'.'.join(loc)}: {what}")
        raise RecipeError("recipe is not valid:\n  " + "\n  ".join(problems)) from None
    recipe.source = path.resolve()
    return recipe


def with_flag(recipe: "Recipe", section: str, field: str, value) -> None:
    """Sets a command-line flag's value (`--steps`: budget.steps) in the recipe, held to the checks a
    recipe's own value gets; RecipeError says why not."""
    current = getattr(recipe, section)
    try:
        updated = type(current).model_validate({**current.model_dump(), field: value})
    except ValidationError as exc:
        raise RecipeError(f"--{field} {value}: {exc.errors()[0]['msg']}") from None
    for _, why in _outsized({field: getattr(updated, field)}):
        raise RecipeError(f"--{field} {value}: {why}")
    setattr(recipe, section, updated)


def _outsized(value, loc: tuple = ()):
    """(loc, why) of every integer past MAX_INTEGER and every infinite or NaN number of a recipe, at any
    depth (fields whose models bound them say so themselves; this holds for every field, and a
    generator's free-form config)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _outsized(item, (*loc, str(key)))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _outsized(item, (*loc, str(i)))
    elif type(value) is int and abs(value) > MAX_INTEGER:
        yield list(loc), f"{value} is larger than any run can use (at most 2**53)"
    elif type(value) is float and not math.isfinite(value):
        yield list(loc), "Input should be a finite number"


def find_line(text: str, loc: list[str]) -> int | None:
    """The line where the field at `loc` (e.g. ["algorithm", "klcoef"]) is written, else its table's line."""
    keys = [p for p in loc if not p.isdigit()]
    if not keys:
        return None
    table, field = keys[:-1], keys[-1]
    current: list[str] = []
    table_line = None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        header = re.match(r"^\[\[?\s*([^\]]+?)\s*\]\]?", stripped)
        if header:
            current = [h.strip() for h in header.group(1).split(".")]
            if current == keys[:len(current)] and table_line is None:
                table_line = number
            continue
        # a key written in its table, as a dotted key, or inside an inline table ({ ... key = ... })
        if current == table[:len(current)] and re.search(rf"(^|[{{,\s.]){re.escape(field)}\s*=", stripped):
            return number
    return table_line


def shipped(name: str) -> Recipe:
    """A recipe shipped with the package (recipes/<name>.toml), wherever Crucible is installed."""
    found = resources.files("crucible.recipes").joinpath(f"{name}.toml")
    # named by where it is (its task files are found beside it), never by a path taken from the current folder
    return parse(found.read_text(), Path(str(found)))


def builtin() -> Recipe:
    """The recipe `crucible train` runs when given none: recipes/digits.toml, shipped with the package."""
    return shipped("digits")
