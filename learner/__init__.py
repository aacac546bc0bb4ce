"""The learner role: actor and critic under DeepSpeed, the PPO math, weight publishing."""
