"""RL: tasks and rewards, losses, learner, pipelines."""
