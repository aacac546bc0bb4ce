"""The learner role: the PPO math, the PPO step and loop, weight publishing; actor and critic
train on the training floor (``training``) the stages stand on too."""
