"""Recipes: one file describes a job; every field has one default; mistakes name the file and the line."""
from __future__ import annotations

import itertools
import json
import tomllib
from pathlib import Path

import pytest
from google.protobuf import json_format

from crucible.cli import recipe as recipes
from crucible.ml import envs, task_sources
from crucible.shared.settings import RunConfig

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def test_every_run_setting_has_one_recipe_section():
    placed = [f for names in recipes.SECTIONS.values() for f in names]
    assert len(placed) == len(set(placed))
    assert set(placed) | set(recipes.SET_BY_THE_JOB) == set(RunConfig.model_fields)


def test_an_empty_recipe_is_the_defaults_and_they_are_runconfigs():
    recipe = recipes.parse("", Path("empty.toml"))
    assert recipe.run_config() == RunConfig()
    assert recipe.algorithm.kl_coef == RunConfig.model_fields["kl_coef"].default


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_recipes_load_and_round_trip(path):
    recipe = recipes.load(path)
    assert recipe.source == path.resolve()
    dumped = recipe.model_dump(exclude_defaults=True, exclude_none=True)
    again = recipes.Recipe.model_validate(dumped)
    assert again.run_config() == recipe.run_config() and again.budget == recipe.budget
    text = path.read_text()
    assert text.lstrip().startswith("#"), "each shipped recipe says what it shows"
    assert tomllib.loads(text)  # plain TOML


def test_the_builtin_recipe_is_the_shipped_digits_file():
    assert recipes.builtin().run_config() == recipes.load(RECIPES / "digits.toml").run_config()
    assert recipes.builtin().run_config().kl_coef == 0.2


@pytest.mark.parametrize("text,line,field,what", [
    ('[algorithm]\nlr = 1e-4\nklcoef = 0.1\n', 3, "algorithm.klcoef", "unknown field"),
    ('[sampling]\n\ntemperature = "hot"\n', 3, "sampling.temperature", "valid number"),
    ('[budget]\nsteps = 10\n[bugdet]\nsteps = 3\n', 3, "bugdet", "unknown field"),
    ('[model]\nname = "builtin"\n[[tasks.sources]]\nfamily = "digits"\njsonll = "x.jsonl"\n', 5,
     "tasks.sources.0.jsonll", "unknown field"),
    ('[algorithm.reward_weights]\nanswer_correct = "a lot"\n', 2, "algorithm.reward_weights.answer_correct",
     "valid number"),
    # no number of a run is infinite or NaN (lr = inf made every weight infinite), nor an integer past 2**53
    ('[algorithm]\nlr = inf\n', 2, "algorithm.lr", "finite number"),
    ('[algorithm]\nlr = 1e-3\nmax_grad_norm = nan\n', 3, "algorithm.max_grad_norm", "finite number"),
    ('[algorithm.reward_weights]\nanswer_correct = -inf\n', 2, "algorithm.reward_weights.answer_correct",
     "finite number"),
    ('[budget]\nminutes = inf\n', 2, "budget.minutes", "finite number"),
    ('[algorithm]\nlr = 2.0\n', 2, "algorithm.lr", "less than or equal to 1"),
    ('[algorithm]\nseed = 99999999999999999999\n', 2, "algorithm.seed", "at most 2**53"),
    ('[[tasks.sources]]\nset = "math"\ncount = 9223372036854775807\n', 3, "tasks.sources.0.count", "at most 2**53"),
    # a value of another type is not read as this one: a quoted number, a float for an integer, a boolean
    ('[algorithm]\nseed = "100000000000000000000"\n', 2, "algorithm.seed", "valid integer"),
    ('[algorithm]\nseed = 1e18\n', 2, "algorithm.seed", "valid integer"),
    ('[budget]\nsteps = true\n', 2, "budget.steps", "valid integer"),
    ('[[tasks.sources]]\nreasoning_gym = "chain_sum"\nconfig = {size = inf}\n', 3, "tasks.sources.0.config.size",
     "finite number"),
    # a field given to a source it does not apply to would do nothing
    ('[[tasks.sources]]\nenvironment = "lookup"\nops = ["parity"]\n', 1, "tasks.sources.0",
     "ops cannot apply to an environment source"),
    ('[[tasks.sources]]\nfamily = "digits"\ncount = 5\n', 1, "tasks.sources.0", "count is for set and reasoning_gym"),
    ('[[tasks.sources]]\nset = "math"\nconfig = {a = 1}\n', 1, "tasks.sources.0", "config is for reasoning_gym"),
])
def test_a_mistake_names_the_file_the_line_and_the_field(text, line, field, what, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(recipes.RecipeError) as err:
        recipes.load(path)
    message = str(err.value)
    assert f"{path}:{line}: {field}:" in message and what in message, message


def test_bad_toml_names_its_line(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[budget]\nsteps = = 3\n")
    with pytest.raises(recipes.RecipeError, match=r"broken.toml: not valid TOML: .*line 2"):
        recipes.load(path)


def test_a_file_that_is_not_utf8_text_is_named_not_a_traceback(tmp_path):
    for path in (tmp_path / "r.toml", tmp_path / "t.jsonl"):
        path.write_bytes(b"[budget]\nsteps = 3 # \xff\n")
    with pytest.raises(recipes.RecipeError, match=r"cannot read recipe .*r.toml: not UTF-8 text \(byte 0xff at offset 21\)"):
        recipes.load(tmp_path / "r.toml")
    with pytest.raises(task_sources.TaskFileError, match=r"cannot read task file .*t.jsonl: not UTF-8 text"):
        task_sources.read_jsonl(tmp_path / "t.jsonl", 4)


def test_a_device_a_pipe_or_a_huge_file_is_refused_at_once_not_read_until_memory_runs_out(tmp_path, monkeypatch):
    import os

    from crucible.shared import files

    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)  # no writer: reading it would wait forever
    for path in ("/dev/zero", fifo, tmp_path):
        with pytest.raises(recipes.RecipeError, match="not a regular file"):
            recipes.load(path)
    monkeypatch.setattr(files, "MAX_TEXT_BYTES", 1000)
    (tmp_path / "big.jsonl").write_text("{}\n" * 1000)
    with pytest.raises(task_sources.TaskFileError, match="larger than"):
        task_sources.read_jsonl(tmp_path / "big.jsonl", 4)
    import io

    with pytest.raises(files.Unreadable, match="larger than"):
        files.read_stdin(io.BytesIO(b"x" * 1001))
    assert files.read_stdin(io.BytesIO(b"x" * 1000)) == "x" * 1000


def test_a_task_file_with_a_bad_line_names_the_line(tmp_path):
    good = '{"id": "a", "kind": "exact", "prompt": "1+1?", "answer": {"answer": "2"}}'
    path = tmp_path / "tasks.jsonl"
    path.write_text(good + "\n\n" + '{"id": "b", "kind": "exact", "prompt": "2+2?", "answr": {}}\n')
    with pytest.raises(task_sources.TaskFileError, match=r"tasks.jsonl:3: JSON does not match"):
        task_sources.read_jsonl(path, 4)
    path.write_text(good + "\n" + '{"id": "c", "kind": "exact", "prompt": "3+3?"}\n')
    with pytest.raises(task_sources.TaskFileError, match=r"tasks.jsonl:2: task 'c': .*needs a 'answer' payload"):
        task_sources.read_jsonl(path, 4)
    path.write_text(good + "\n" + good + "\n")
    with pytest.raises(task_sources.TaskFileError, match=r"tasks.jsonl:2: task id 'a' already used on line 1"):
        task_sources.read_jsonl(path, 4)


def test_held_out_tasks_are_a_stable_split_and_never_in_the_training_stream():
    recipe = recipes.load(RECIPES / "my-tasks.toml")
    train, heldout = task_sources.streams(
        recipe.tasks.sources, seed=0, group_size=4, heldout_fraction=recipe.heldout.fraction, heldout_file=None,
        heldout_size=100, base=recipe.source.parent)
    again = task_sources.streams(
        recipe.tasks.sources, seed=7, group_size=4, heldout_fraction=recipe.heldout.fraction, heldout_file=None,
        heldout_size=100, base=recipe.source.parent)[1]
    assert heldout and [t.id for t in heldout] == [t.id for t in again]
    assert all(t.split == "heldout" for t in heldout)
    held_ids = {t.id for t in heldout}
    seen = [next(train) for _ in range(200)]
    assert all(t.split == "train" and t.id.split("#")[0] not in held_ids for t in seen)
    assert all(t.group_size == 4 for t in seen)


def test_a_saved_recipe_with_every_field_written_reads_back():
    """A run's state holds its recipe as JSON with every field, defaults too (what --resume reads)."""
    for path in sorted(RECIPES.glob("*.toml")):
        recipe = recipes.load(path)
        saved = recipe.model_dump(mode="json")
        assert recipes.Recipe.model_validate(json.loads(json.dumps(saved))).model_dump(mode="json") == saved, path


def test_held_out_tasks_are_never_training_tasks_whatever_the_sources_say(tmp_path):
    """A held-out file repeating training tasks, a task listed in two sources, a task its file marks held
    out, a split that leaves nothing held out: each refused (or honoured), never a run that trains on
    what it measures."""
    def jsonl(name, ids, **fields):
        path = tmp_path / name
        path.write_text("".join(json.dumps({"id": i, "kind": "exact", "prompt": f"{i}?", "answer": {"answer": "1"},
                                            **fields.get(i, {})}) + "\n" for i in ids))
        return path

    def run(sources, heldout_file=None, fraction=0.5):
        return task_sources.streams([recipes.TaskSource(jsonl=str(s)) for s in sources], seed=0, group_size=2,
                                    heldout_fraction=fraction, heldout_file=heldout_file, heldout_size=100,
                                    base=tmp_path)

    ids = [f"q{i}" for i in range(20)]
    train = jsonl("train.jsonl", ids)
    with pytest.raises(ValueError, match="held-out task 'q3' is training task 'q3'"):
        run([train], heldout_file=jsonl("held.jsonl", ["q3"]))
    renamed = tmp_path / "renamed.jsonl"  # the same question under another id
    renamed.write_text(json.dumps({"id": "other", "kind": "exact", "prompt": "q3?", "answer": {"answer": "1"}}) + "\n")
    with pytest.raises(ValueError, match="held-out task 'other' is training task 'q3'"):
        run([train], heldout_file=renamed)
    # a task two sources hold is the first's: trained once, and never held out from one, trained from another
    first = jsonl("first.jsonl", ids, q1={"split": "heldout"})
    stream, heldout = run([first, jsonl("again.jsonl", ["q0", "n0"])], fraction=0.0)
    drawn = [next(stream).id.split("#")[0] for _ in range(200)]
    assert [t.id for t in heldout] == ["q1"] and "n0" in drawn and "q1" not in drawn
    assert drawn.count("q0") == drawn.count("q2")  # from the first source only
    # the same id for another question is another task (generated sources number their own)
    other, trained_id = tmp_path / "other.jsonl", next(i for i in ids if not task_sources.in_heldout(i, 0.5))
    other.write_text(json.dumps({"id": trained_id, "kind": "exact", "prompt": "another?", "answer": {"answer": "2"}})
                     + "\n")
    assert run([train, other])[1]
    # an environment's prompt names no task: its instance does (lookup asks "color of b?" of many tables)
    lookup = envs.get("lookup")
    tables = [t for _, t in zip(range(40), lookup.generate("train", seed=3, group_size=1))]
    assert len({t.prompt for t in tables}) < len(tables)
    env_file = tmp_path / "lookup.jsonl"
    env_file.write_text("".join(json_format.MessageToJson(t, indent=None) + "\n" for t in tables))
    held_file = tmp_path / "lookup_held.jsonl"
    held_file.write_text("".join(json_format.MessageToJson(t, indent=None) + "\n"
                                 for _, t in zip(range(10), lookup.generate("heldout", seed=4, group_size=1))))
    assert len(run([env_file], heldout_file=held_file)[1]) == 10
    assert 2 <= len(run([env_file], fraction=0.2)[1]) <= 20
    with pytest.raises(ValueError, match="no held-out tasks"):
        run([train], fraction=0.0)
    marked = jsonl("marked.jsonl", ids, q1={"split": "heldout"})
    stream, heldout = run([marked], fraction=0.0)
    assert [t.id for t in heldout] == ["q1"]
    assert "q1" not in {next(stream).id.split("#")[0] for _ in range(60)}
    with pytest.raises(ValueError, match="marked split"):
        run([marked], heldout_file=jsonl("held2.jsonl", ["z"]))
    # a question a file holds twice under two ids is held out whole, where either copy is
    marked_twice = jsonl("marked_twice.jsonl", ids + ["dup"], q1={"split": "heldout"}, dup={"prompt": "q1?"})
    stream, heldout = run([marked_twice], fraction=0.0)
    assert sorted(t.id for t in heldout) == ["dup", "q1"]
    assert {"q1", "dup"}.isdisjoint({next(stream).id.split("#")[0] for _ in range(60)})


def test_command_line_flags_are_held_to_the_recipes_own_bounds(tmp_path, monkeypatch, capsys):
    from crucible.cli import main

    def started(settings):
        raise AssertionError("the stack was started for flags that cannot run")

    monkeypatch.setattr(main, "ensure_stack", started)
    for flags, says in [(["--steps", "0"], "--steps 0: Input should be greater than or equal to 1"),
                        (["--minutes", "nan"], "--minutes nan: Input should be a finite number"),
                        (["--seed", str(2 ** 70)], "larger than any run can use"),
                        (["--resume", ""], "is not a run id")]:
        assert main.main(["train", *flags]) == 2, flags
        assert says in capsys.readouterr().out, flags
    path = tmp_path / "r.toml"
    path.write_text("[tasks]\nsources = []\n")
    assert main.main(["train", str(path)]) == 2
    assert "tasks.sources: List should have at least 1 item" in capsys.readouterr().out


@pytest.mark.parametrize("ops", [("parity",), ("parity", "size")])
def test_digits_answers_are_balanced_in_every_stretch_and_still_right(ops):
    from crucible.ml.task_families import ANSWERS, OPS, digits_tasks
    for split in ("train", "heldout"):
        tasks = list(itertools.islice(digits_tasks(split, seed=3, ops=ops), 2000))
        assert all(t.split == split and t.answer.answer == str(OPS[t.metadata["op"]](
            [int(d) for d in t.prompt.split()[1:-1]])) for t in tasks)
        for op in ops:
            answers = [t.answer.answer == ANSWERS[op][0] for t in tasks if t.metadata["op"] == op]
            for i in range(len(answers) - 32):
                assert abs(sum(answers[i:i + 32]) - 16) <= 1, (op, i)
    prompts = [t.prompt for t in itertools.islice(digits_tasks("train", seed=3, ops=ops), 2000)]
    assert len(set(prompts)) > 1500, "the digits are still drawn at random"


@pytest.mark.parametrize("rate", [0.25, 0.3, 0.125, 0.5])
def test_canaries_come_at_their_rate_in_every_stretch_of_the_stream_at_random_places(rate):
    recipe = recipes.shipped("planted-hack")
    recipe.tasks.sources[0].canaries = rate
    streams = [task_sources.streams(recipe.tasks.sources, seed=seed, group_size=8, heldout_fraction=0.2,
                                    heldout_file=None, heldout_size=10, base=RECIPES)[0] for seed in (0, 1)]
    marks = [[next(train).metadata.get("canary") == "true" for _ in range(2000)] for train in streams]
    window = 16  # a step of the planted-hack recipe
    for seen in marks:
        assert abs(sum(seen) / len(seen) - rate) < 0.01
        counts = {sum(seen[i:i + window]) for i in range(len(seen) - window)}
        assert min(counts) >= int(rate * window) - 1 and max(counts) <= int(rate * window) + 2, counts
    assert marks[0] != marks[1], "where the canaries fall is drawn, not a fixed stride"
    gaps = {b - a for a, b in itertools.pairwise(i for i, c in enumerate(marks[0]) if c)}
    assert len(gaps) > 2, gaps


@pytest.mark.kafka
def test_crucible_submit_publishes_signed_tasks_or_names_every_bad_line(settings, tmp_path, capsys):
    import asyncio
    import json

    from crucible.cli.main import main as crucible_main
    from crucible.shared import integrity
    from crucible.v1 import task_pb2
    from tests.test_bus import read_raw

    env = {"CRUCIBLE_KAFKA_BOOTSTRAP": settings.kafka_bootstrap, "CRUCIBLE_TOPIC_PREFIX": settings.topic_prefix,
           "CRUCIBLE_HOME": str(settings.home)}
    good = [{"id": f"s{i}", "kind": "exact", "prompt": "2+2=", "group_size": 2, "answer": {"answer": "4"}}
            for i in range(3)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([json.dumps(good[0]), '{"id": "x", "kind": "exact"', json.dumps({**good[1], "kind": "haiku"}),
                              json.dumps(good[0])]) + "\n")
    ok = tmp_path / "ok.jsonl"
    ok.write_text("\n".join(json.dumps(t) for t in good) + "\n")
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, env):
        from crucible.shared.settings import get_settings

        get_settings.cache_clear()
        try:
            assert crucible_main(["submit", str(bad)]) == 2
            out = capsys.readouterr().out
            assert f"{bad}:2: invalid JSON" in out and f"{bad}:3:" in out and "unknown kind 'haiku'" in out
            assert f"{bad}:4: task id 's0' already used on line 1" in out and "nothing was published" in out
            (tmp_path / "latin1.jsonl").write_bytes(json.dumps(good[0]).encode()[:-2] + b'\xe9"}\n')
            assert crucible_main(["submit", str(tmp_path / "latin1.jsonl")]) == 2
            assert "latin1.jsonl: not UTF-8 text (byte 0xe9" in capsys.readouterr().out
            (tmp_path / "heldout.jsonl").write_text(json.dumps({**good[0], "split": "heldout"}) + "\n")
            assert crucible_main(["submit", str(tmp_path / "heldout.jsonl")]) == 2
            assert "has split 'heldout'" in capsys.readouterr().out
            # A task file's text reaches the terminal as text: a JSON key quoted by the parser's error, and an
            # entry point quoted by a problem, once set the window title, cleared the screen, hid the rest.
            evil = tmp_path / "evil.jsonl"
            evil.write_text(json.dumps({**good[0], "\x1b]0;PWNED\x07\x1b[2J\rpublished 1 task(s)\n": 1}) + "\n"
                            + json.dumps({**good[1], "python_tests": {"entry_point": "f\x1b[8m", "test_code": "x"}})
                            + "\n")
            assert crucible_main(["submit", str(evil)]) == 2
            out = capsys.readouterr().out
            assert "\x1b" not in out and "\r" not in out and "\x07" not in out, out
            assert "\\x1b]0;PWNED" in out and "nothing was published" in out
            huge = tmp_path / "huge.toml"
            huge.write_text("[sampling]\ngroup_size = 1000000000\n")
            assert crucible_main(["train", str(huge)]) == 2  # refused before anything starts
            assert "sampling.group_size 1000000000 is above the limit of 64" in capsys.readouterr().out
            assert crucible_main(["submit", str(ok)]) == 0
        finally:
            get_settings.cache_clear()
    records = asyncio.run(read_raw(settings, "tasks", 3))
    published = [task_pb2.Task.FromString(r.value) for r in records]
    assert [t.id for t in published] == ["s0", "s1", "s2"]
    secret = integrity.key(settings)
    assert all(integrity.signed_correctly(t, secret) for t in published)


@pytest.mark.kafka
@pytest.mark.store
def test_crucible_status_reports_lag_versions_and_alerts_and_says_what_is_down(stack_settings, capsys):
    from crucible.cli.status import report
    from crucible.shared import store

    store.migrate(store.connect(stack_settings))
    assert report(stack_settings) == 0
    out = capsys.readouterr().out
    assert "Kafka" in out and ": up" in out and "store" in out
    down = stack_settings.model_copy(update={"kafka_bootstrap": "127.0.0.1:1", "clickhouse_url": "http://127.0.0.1:1"})
    assert report(down) == 1
    out = capsys.readouterr().out
    assert out.count("not answering") == 2 and "crucible up" in out


def test_a_recipe_that_cannot_run_is_refused_before_kafka_and_the_store_are_started(tmp_path, monkeypatch, capsys):
    """Its model, task sources and held-out tasks are checked first: nothing is started for a run that
    would be refused once started (an unknown family, a missing task file, an unknown model, a grade
    kind for rescore)."""
    from crucible.cli import main

    def started(settings):
        raise AssertionError("the stack was started for a recipe that cannot run")

    monkeypatch.setattr(main, "ensure_stack", started)
    cases = {'[[tasks.sources]]\nfamily = "nope"\n': "unknown task family 'nope'",
             '[[tasks.sources]]\njsonl = "missing.jsonl"\n': "missing.jsonl",
             '[heldout]\nfile = "gone.jsonl"\n': "gone.jsonl",
             '[model]\nname = "no-such-model"\n': "unknown model 'no-such-model'",
             '[[tasks.sources]]\nenvironment = "nope"\n': "nope",
             # every task of it refused by the generator: a run that would wait for samples for ever
             '[[tasks.sources]]\nreasoning_gym = "game_of_life_halting"\n': "ignores the question"}
    for text, says in cases.items():
        path = tmp_path / "r.toml"
        path.write_text(text)
        assert main.main(["train", str(path)]) == 2, text
        out = capsys.readouterr().out
        assert "cannot run this recipe" in out and says in out, (text, out)
    assert main.main(["rescore", "--run", "r1", "--grade-as", "exact=nonsense"]) == 2
    assert "not a task kind" in capsys.readouterr().out
    # a verifier elsewhere: the run it serves is named (the run's tasks are signed for it), never assumed
    assert main.main(["rescore", "--run", "r1", "--verifier", "127.0.0.1:1"]) == 2
    assert "--verifier needs --verifier-run" in capsys.readouterr().out
    assert main.main(["rescore", "--run", "r1", "--verifier", "127.0.0.1:1", "--verifier-run", "a b"]) == 2
    assert "is not a run id" in capsys.readouterr().out


def test_a_query_parameter_that_is_not_utf8_is_named_not_blamed_on_the_store(capsys):
    from crucible.cli import main

    assert main.main(["query", "task", "--task", "rt-\udcff\udcfe"]) == 2  # argv's bytes 0xff 0xfe
    assert "--task is not UTF-8 text" in capsys.readouterr().out


def test_a_shipped_recipe_is_found_where_it_is_installed_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where recipes/ is nothing of Crucible's
    assert recipes.builtin().source.is_file()
    recipe = recipes.shipped("my-tasks")
    train, heldout = task_sources.streams(recipe.tasks.sources, seed=0, group_size=2, heldout_fraction=0.2,
                                          heldout_file=None, heldout_size=10, base=recipe.source.parent)
    assert heldout and next(train).id


def test_recipe_values_that_could_not_reach_the_services_are_refused_in_the_recipe(tmp_path):
    path = tmp_path / "r.toml"
    for text, says in [('[model]\nsystem_prompt = "a\\u0000b"\n', "system_prompt"),
                       ("[model]\nsystem_prompt = \"" + "x" * 20_000 + "\"\n", "at most 16384"),
                       ("[algorithm]\nreward_weights = {" + ", ".join(f"c{i} = 1.0" for i in range(100)) + "}\n",
                        "reward_weights")]:
        path.write_text(text)
        with pytest.raises(recipes.RecipeError, match=says):
            recipes.load(path)
