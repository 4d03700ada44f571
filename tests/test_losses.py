"""Loss functions and advantages against values computed by hand."""
import math

import pytest
import torch

from crucible.ml import advantages
from crucible.ml.policy.losses import dpo_loss, grpo_loss, kl_penalty, ppo_loss


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_kl_penalty_by_hand():
    # d = logp - ref = -1.0 - (-0.5) = -0.5: d^2 / 2
    assert float(kl_penalty(t([-1.0]), t([-0.5]))) == pytest.approx(0.125)
    assert float(kl_penalty(t([-2.0]), t([-2.0]))) == 0.0


def expected_penalty_gradient(logits: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """E over tokens o ~ pi_theta of the gradient (through log pi_theta(o) only, as in training on
    sampled tokens) of the KL penalty, summed exactly over the vocabulary."""
    probs = torch.softmax(logits, -1).detach()
    total = torch.zeros_like(logits)
    for o in range(logits.numel()):
        leaf = logits.detach().clone().requires_grad_(True)
        logp = torch.log_softmax(leaf, -1)[o:o + 1][None]
        kl_penalty(logp, ref[o:o + 1][None]).sum().backward()
        total += probs[o] * leaf.grad
    return total


def test_the_kl_penalty_follows_the_gradient_of_kl_to_the_reference():
    logits = torch.tensor([2.0, 0.0, -1.0, 0.5])
    ref = torch.log_softmax(torch.tensor([0.0, 1.0, 0.0, -2.0]), -1)
    leaf = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(leaf, -1)
    (logp.exp() * (logp - ref)).sum().backward()  # KL(pi_theta || pi_ref), exactly
    assert torch.allclose(expected_penalty_gradient(logits, ref), leaf.grad, atol=1e-5)


def test_an_unlikely_sampled_token_does_not_dominate_the_step():
    """A sharp policy (0.999 on its answer) that samples the other answer, which the reference gives
    even odds: the penalty's pull on that one token stays of the order of an advantage (a log-ratio,
    ~6), where exp(-d) + d - 1 (k3) pulls with pi_ref / pi_theta - 1 ~ 500."""
    leaf = torch.tensor([math.log(0.999), math.log(0.001)], requires_grad=True)
    logp = torch.log_softmax(leaf, -1)[1:][None]
    ref = torch.tensor([[math.log(0.5)]])
    kl_penalty(logp, ref).sum().backward()
    assert 1.0 < leaf.grad.abs().max() < 10.0


def test_grpo_loss_by_hand():
    # Two completions of two tokens; the second token of completion 2 is padding.
    logp = t([math.log(0.6), math.log(0.5)], [math.log(0.3), 0.0])
    old = t([math.log(0.5), math.log(0.5)], [math.log(0.5), 0.0])
    ref = old.clone()
    adv = torch.tensor([1.0, -1.0])
    mask = t([1, 1], [1, 0])
    loss, stats = grpo_loss(logp, old, ref, adv, mask, clip_eps=0.2, kl_coef=0.1, entropy_coef=0.0)
    # ratios: 1.2 (A=+1: min(1.2, clip 1.2) = 1.2), 1.0 (A=+1: 1.0), 0.6 (A=-1: min(-0.6, -0.8) = -0.8)
    surrogate = [-1.2, -1.0, 0.8]
    log_ratio = [math.log(0.6 / 0.5), 0.0, math.log(0.3 / 0.5)]
    expected = sum(s + 0.1 * d * d / 2 for s, d in zip(surrogate, log_ratio)) / 3
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert stats["clip_fraction"] == pytest.approx(1 / 3)
    assert stats["kl"] == pytest.approx(sum(log_ratio) / 3, rel=1e-5)


def test_grpo_gradient_pushes_up_positive_advantage():
    logits = torch.zeros(2, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[None, :1]  # the token of a completion with A > 0
    loss, _ = grpo_loss(logp, logp.detach(), logp.detach(), torch.tensor([1.0]), torch.ones(1, 1), clip_eps=0.2, kl_coef=0.0,
                        entropy_coef=0.0)
    loss.backward()
    assert logits.grad[0] < 0  # descending the loss raises that token's logit


def test_ppo_loss_puts_kl_in_the_advantage():
    logp = t([math.log(0.5)])
    old = t([math.log(0.5)])
    ref = t([math.log(0.25)])
    loss, _ = ppo_loss(logp, old, ref, torch.tensor([1.0]), torch.ones(1, 1), clip_eps=0.2, kl_coef=0.5,
                       entropy_coef=0.0)
    # A' = 1 - 0.5 * (log 0.5 - log 0.25) = 1 - 0.5 ln 2; ratio 1 -> loss = -A'
    assert float(loss) == pytest.approx(-(1 - 0.5 * math.log(2)), rel=1e-6)


def test_dpo_loss_by_hand():
    loss, stats = dpo_loss(torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]),
                           beta=0.5)
    # margin = 0.5 * ((-1 + 2) - (-3 + 2)) = 1.0; loss = -log sigmoid(1)
    assert float(loss) == pytest.approx(-math.log(1 / (1 + math.exp(-1.0))), rel=1e-6)
    assert stats["dpo_accuracy"] == 1.0


def test_advantage_estimators_by_hand():
    assert advantages.grpo([1.0, 0.0]) == pytest.approx([1.0, -1.0], abs=1e-5)
    assert advantages.grpo([0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0]
    assert advantages.rloo([3.0, 0.0, 0.0]) == pytest.approx([3.0, -1.5, -1.5])
    assert advantages.reinforce([1.0, 0.0], baseline=0.25) == [0.75, -0.25]
    assert advantages.grpo([1.0]) == [0.0]
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        advantages.advantages("ppo", [1.0])


def test_health_monitor_raises_each_signal_once():
    from crucible.services.learner.monitors import HealthMonitor

    monitor = HealthMonitor("run", kl_limit=1.0, entropy_floor=0.05, min_steps=2, window=3, reward_gain=0.2)
    calm = {"kl": 0.1, "entropy": 1.0, "reward_mean": 0.1}
    assert monitor.check(1, 1, {**calm, "kl": 9.0}) == []  # too early to judge
    assert monitor.check(2, 2, calm) == []
    [alert] = monitor.check(3, 3, {**calm, "kl": 2.5})
    assert alert.kind == "kl_blowup" and "2.500" in alert.message
    assert monitor.check(4, 4, {**calm, "kl": 3.0}) == []  # still firing: no second alert
    assert monitor.check(5, 5, calm) == []                  # recovered
    assert [a.kind for a in monitor.check(6, 6, {**calm, "kl": 5.0, "entropy": 0.01})] == ["kl_blowup",
                                                                                           "entropy_collapse"]

    # Reward up by 0.6 while the held-out pass rate stays put.
    diverging = HealthMonitor("run", min_steps=0, reward_window=3, reward_gain=0.2)
    diverging.record_heldout(0, 0.5)
    alerts = []
    for step, reward in enumerate([0.1, 0.1, 0.1, 0.7, 0.7, 0.7], start=1):
        alerts += diverging.check(step, step, {**calm, "reward_mean": reward})
    assert alerts == []  # one held-out point is not a trend
    diverging.record_heldout(6, 0.5)
    [alert] = diverging.check(7, 7, {**calm, "reward_mean": 0.7})
    assert alert.kind == "reward_without_heldout"


def test_a_policy_sure_of_answers_it_learned_is_no_entropy_collapse():
    from crucible.services.learner.monitors import HealthMonitor

    monitor = HealthMonitor("run", entropy_floor=0.05, min_steps=2, window=3, reward_gain=0.2)
    for step, reward in enumerate([0.3, 0.3, 0.4, 0.6, 0.8, 0.9], start=1):
        assert monitor.check(step, step, {"kl": 0.1, "entropy": 0.5, "reward_mean": reward}) == []
    assert monitor.check(7, 7, {"kl": 0.1, "entropy": 0.01, "reward_mean": 1.0}) == []
    stuck = HealthMonitor("run", entropy_floor=0.05, min_steps=2, window=3, reward_gain=0.2)
    for step, reward in enumerate([0.3, 0.3, 0.4, 0.3, 0.4], start=1):
        assert stuck.check(step, step, {"kl": 0.1, "entropy": 0.5, "reward_mean": reward}) == []
    [alert] = stuck.check(6, 6, {"kl": 0.1, "entropy": 0.01, "reward_mean": 0.3})
    assert alert.kind == "entropy_collapse" and "0.0100" in alert.message


def test_health_monitor_catches_responses_blowing_up_once():
    from crucible.services.learner.monitors import HealthMonitor

    monitor = HealthMonitor("run", min_steps=0, window=3, length_factor=3.0, length_floor=16)
    calm = {"kl": 0.1, "entropy": 1.0, "reward_mean": 0.1}
    fired = []
    for step, length in enumerate([6, 7, 8, 9, 14, 30, 40, 42, 8, 35], start=1):
        fired += [(step, a.kind) for a in monitor.check(step, step, {**calm, "response_length": length})]
    # 21 tokens is 3x the first three steps' 7: it fires at 30, stays quiet while it lasts, again after recovery
    assert fired == [(6, "length_blowup"), (10, "length_blowup")]
    short = HealthMonitor("run", min_steps=0, window=3)
    assert not any(short.check(s, s, {**calm, "response_length": n}) for s, n in enumerate([1, 1, 1, 5, 9], 1))


def test_an_honest_rise_early_does_not_hide_a_reward_that_then_rises_alone():
    from crucible.services.learner.monitors import HealthMonitor

    monitor = HealthMonitor("run", min_steps=0, reward_window=3, reward_gain=0.2)
    calm = {"kl": 0.1, "entropy": 1.0}
    fired = []
    # held-out rises with the reward at first (0.4 -> 0.6 by step 6), then stays at 0.6 while the
    # training reward climbs on to 0.95
    rewards = [0.4, 0.4, 0.45, 0.5, 0.55, 0.6, 0.7, 0.8, 0.9, 0.95, 0.95, 0.95]
    for step, reward in enumerate(rewards, start=1):
        if step == 1:
            monitor.record_heldout(0, 0.4)
        if step == 7:
            monitor.record_heldout(6, 0.6)
        if step == 12:
            monitor.record_heldout(11, 0.6)
        fired += [(step, a.kind) for a in monitor.check(step, step, {**calm, "reward_mean": reward})]
    assert fired == [(12, "reward_without_heldout")], fired
    # a policy sharpening: the sampled training reward still climbs towards a greedy held-out score
    # that has levelled off above it (the clean planted-hack twin on CI): no alert
    sharpening = HealthMonitor("run", min_steps=0, reward_window=3, reward_gain=0.2)
    sharpening.record_heldout(0, 0.4)
    alerts = []
    for step, reward in enumerate([0.45, 0.5, 0.5, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.76], start=1):
        if step == 4:
            sharpening.record_heldout(3, 0.84)
        if step == 10:
            sharpening.record_heldout(9, 0.84)
        alerts += sharpening.check(step, step, {**calm, "reward_mean": reward})
    assert alerts == []


def test_a_reward_rising_after_the_last_evaluation_is_not_held_against_it():
    """The clean planted-hack twin: held-out (sampled) 0.51 at version 0 and 0.52 at version 20, the
    training reward flat to version 20 and climbing after it. Read at the last evaluation it has not
    risen yet; read now it has (the monitor once compared the newest rewards with a rate ten versions
    older, and fired); the next evaluation shows the held-out rate rising with it."""
    from crucible.services.learner.monitors import HealthMonitor

    monitor = HealthMonitor("run", min_steps=0, reward_window=5, reward_gain=0.2)
    calm = {"kl": 0.1, "entropy": 1.0}
    rewards = [0.37] * 20 + [0.4, 0.45, 0.5, 0.55, 0.6, 0.62, 0.63, 0.64, 0.65, 0.66, 0.68, 0.7]
    fired = []
    for version, reward in enumerate(rewards, start=1):
        if version == 1:
            monitor.record_heldout(0, 0.51)
        if version == 24:
            monitor.record_heldout(20, 0.52)
        fired += monitor.check(version, version, {**calm, "reward_mean": reward})
    monitor.record_heldout(30, 0.66)
    fired += monitor.check(33, 33, {**calm, "reward_mean": 0.7})
    assert fired == []
    # the same rise with the held-out rate still flat at version 30 is the alarm
    monitor.record_heldout(40, 0.52)
    for version in range(34, 42):
        fired += monitor.check(version, version, {**calm, "reward_mean": 0.7})
    assert [a.kind for a in fired] == ["reward_without_heldout"]
