"""A training run: the step loop (`trainer`) over a rollout backend and a learner host, the
task it samples (`task`), the rollouts in flight (`window`), checkpoints (`checkpoint`),
the run directory (`rundir`), the draft a run starts from (`draft`), what a run reports
(`report`, `samples`, `loggers`: TensorBoard, W&B, MLflow) and what it exports (`export`,
`export_source`)."""
