"""What `crucible train` feeds, and which policy version each task asks for (cli/train.py TaskFeed):
pure bookkeeping, no bus."""
from __future__ import annotations

from crucible.cli.train import TaskFeed, feeds_ahead


def test_within_the_lag_bound_every_task_asks_for_the_version_reached():
    feed = TaskFeed(groups_per_step=4, max_policy_lag=1)
    assert feed.due() == [0] * 8  # before any version: steps 1 and 2
    assert feed.due() == []
    feed.reached(0)
    assert feed.due() == []  # version 0 is where the run starts: still steps 1 and 2
    feed.reached(1)
    assert feed.due() == [1] * 4
    feed.reached(3)  # two versions at once: two steps
    assert feed.due() == [3] * 8


def test_the_step_fed_early_asks_for_the_next_version_and_counts_once_it_is_reached():
    feed = TaskFeed(groups_per_step=4, max_policy_lag=1)
    feed.reached(0)
    assert feed.due(early=True) == [0] * 8 + [1] * 4
    assert feed.due(early=True) == []  # held already: not fed twice
    feed.reached(1)
    # The held step is now within the bound: nothing more is due for now, the next step is fed early.
    assert feed.due(early=True) == [2] * 4
    feed.reached(2)
    assert feed.due(early=False) == []  # no longer early: the held step counts, nothing is added
    feed.reached(3)
    assert feed.due(early=False) == [3] * 4
    assert feed.fed_early == 8
    assert feed.published == 20 and feed.held == 0


def test_a_stalled_learner_gets_a_step_it_can_sample_now_even_with_a_step_held():
    feed = TaskFeed(groups_per_step=4, max_policy_lag=1)
    feed.reached(5)
    feed.due(early=True)
    # Samples were lost: the learner waits at version 5. Another step, asking for version 5, not 6.
    assert feed.due(extra=1, early=True) == [5] * 4
    # Each group dynamic sampling filtered is replaced at once, with the version reached.
    assert feed.due(extra=1, filtered=3, early=True) == [5] * 3


def test_sync_runs_feed_early_too_and_runs_without_a_bound_do_not():
    feed = TaskFeed(groups_per_step=2, max_policy_lag=0)
    feed.reached(0)
    assert feed.due(early=True) == [0, 0, 1, 1]  # step 1 with version 0; step 2 waits for version 1
    assert feeds_ahead(0, [0.4, 0.5]) and feeds_ahead(1, [0.4])
    assert not feeds_ahead(-1, [0.4])  # no lag bound: nothing to hold tasks for
    assert not feeds_ahead(1, [])  # no version interval known yet
    assert not feeds_ahead(1, [60.0, 50.0, 0.3])  # versions slower than the generator holds a task
