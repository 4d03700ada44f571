"""The learner's learning-rate schedule (pure logic): decay to a tenth, and the optional warm-up."""
from crucible.services.learner.trainer import scheduled_lr
from crucible.shared.settings import RunConfig


def test_constant_without_schedule():
    config = RunConfig(lr=1e-3)
    assert [scheduled_lr(config, s) for s in (0, 10, 1000)] == [1e-3, 1e-3, 1e-3]


def test_decay_reaches_a_tenth_and_stays():
    config = RunConfig(lr=1e-3, lr_decay_steps=80)
    assert scheduled_lr(config, 0) == 1e-3
    assert abs(scheduled_lr(config, 40) - 1e-3 * 0.55) < 1e-12
    assert abs(scheduled_lr(config, 80) - 1e-4) < 1e-12
    assert abs(scheduled_lr(config, 500) - 1e-4) < 1e-12


def test_warmup_rises_linearly_then_follows_the_decay():
    config = RunConfig(lr=1e-3, lr_decay_steps=80, lr_warmup_steps=10)
    undecayed = RunConfig(lr=1e-3, lr_decay_steps=80)
    rates = [scheduled_lr(config, s) for s in range(12)]
    assert abs(rates[0] - scheduled_lr(undecayed, 0) / 10) < 1e-15
    assert all(a < b for a, b in zip(rates[:10], rates[1:10]))  # rising during the warm-up
    for s in (9, 10, 11, 50):  # from its last step on, exactly the decayed rate
        assert abs(scheduled_lr(config, s) - scheduled_lr(undecayed, s)) < 1e-15
