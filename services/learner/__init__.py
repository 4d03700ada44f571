"""The learner: policy-gradient (or DPO) steps on trajectories, checkpoints, new policy versions."""
