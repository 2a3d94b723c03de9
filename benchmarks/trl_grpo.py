"""TRL's GRPOTrainer, timed per RL step on specroll's default workload (a baseline).

The workload is `specroll train` with no arguments (the `default` preset, read through
`build_config`): SmolLM2-135M-Instruct as the fp32 HF directory specroll materialises
(`specroll.model.hub`), the procedural math task's prompts in the order specroll's
trainer draws them (levels [1, 2], a pool of 64, `Task.problems(step)` for steps
0..N-1), each through the chat template with the "Answer:" reply prefix, exactly the
prompt ids specroll's requests hold; 8 prompts x 8 samples = 64 sequences per step,
128 new tokens at most, temperature 1.0, and specroll's own reward (`reward.functions`,
`math`, scored by its reward worker as the trainer scores it). TRL generates with
transformers `generate` (no vLLM), fp32, no KL (beta 0), one optimizer update per step
(micro-batches of policy.micro_batch = 16 sequences accumulated), AdamW with specroll's
lr, betas (0.9, 0.99), weight decay, grad clip, constant schedule; DAPO token-mean loss
with clip 0.2 / 0.28 and group-std scaled advantages, as the preset's loss section.

Not matched (specroll-only, no TRL equivalent): speculative rollouts and the online
EAGLE-3 draft training, dropping groups whose rewards are all equal (TRL keeps them at
advantage 0 in the batch), per-request sampling seeds, validation and checkpoints.

Each step's wall time is the interval between the trainer's consecutive `on_step_end`
callbacks (the first from `on_train_begin`): generation, reward, forward/backward and
the update, nothing skipped; `inner_step_s` is on_step_begin to on_step_end. The last
line printed is one JSON object (also written to OUT/result.json).

Set-up (a venv of its own, so that TRL's dependencies stay out of the project's), from
the repository root; `torch==2.13.0` as in the README's install line:

    python3 -m venv .venv-trl
    .venv-trl/bin/pip install torch==2.13.0 -e . trl

Run (SPECROLL_HOME: where specroll keeps the model, ~/.cache/specroll by default):

    .venv-trl/bin/python benchmarks/trl_grpo.py                 # 10 steps, the preset
    .venv-trl/bin/python benchmarks/trl_grpo.py --steps 2 --prompts-per-step 2 \\
        --group 2 --max-new-tokens 16                           # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import TrainerCallback

from specroll.model import hub
from specroll.model.tokenizer import Tokenizer
from specroll.rl.config import TrainConfig, build_config
from specroll.rl.run.task import Task

PRESET = "default"
LOG_KEYS = ("reward", "completions/mean_length", "step_time", "loss", "grad_norm")
"""TRL's per-step logs kept in the result (each a list over steps); TRL's own step_time
sums its training_step calls only (generation, reward, forward, backward: no gradient
clip, no optimizer step)."""


def parse_args() -> argparse.Namespace:
    d = build_config(PRESET, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10, help="RL steps (default 10)")
    p.add_argument("--prompts-per-step", type=int, default=d.data.prompts_per_step)
    p.add_argument("--group", type=int, default=d.data.group_size, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=d.rollout.max_new_tokens)
    p.add_argument("--out", default="", help="TRL's output_dir (default: a new temp dir)")
    args = p.parse_args()
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def workload(args: argparse.Namespace) -> TrainConfig:
    """The default preset with the command line's sizes (validated by specroll)."""
    return build_config(
        PRESET,
        [
            f"data.prompts_per_step={args.prompts_per_step}",
            f"data.group_size={args.group}",
            f"rollout.max_new_tokens={args.max_new_tokens}",
        ],
    )


def micro_batch(cfg: TrainConfig) -> int:
    """Sequences per forward: policy.micro_batch, or the largest divisor of the step's
    sequences below it (TRL needs whole micro-batches in its one update)."""
    total = cfg.data.prompts_per_step * cfg.data.group_size
    return max(m for m in range(1, min(cfg.policy.micro_batch, total) + 1) if total % m == 0)


def prompt_rows(cfg: TrainConfig, task: Task, tok: Tokenizer, steps: int):
    """The dataset rows of steps 0..steps-1 in specroll's order, and their problems.

    Each prompt is the text of specroll's prompt ids (chat template, assistant header,
    "Answer:"); TRL tokenizes plain-text prompts with its processing class, and the ids
    it gets are checked to be specroll's own."""
    problems, rows = [], []
    for s in range(steps):
        for p in task.problems(s):
            ids = task.encode(p)
            text = tok.hf.decode(ids, skip_special_tokens=False)
            again = tok.hf(text=text)["input_ids"]
            if list(again) != list(ids):
                raise RuntimeError(f"TRL would tokenize prompt {p.uid} differently: {text!r}")
            rows.append({"prompt": text, "problem": len(problems)})
            problems.append(p)
    return rows, problems


def reward_function(task: Task, problems: list):
    """A TRL reward function that scores with specroll's reward set, as its trainer does:
    the record's answer, the reply prefix + the decoded completion ids."""
    calls = {"n": 0, "seconds": 0.0}

    def specroll_reward(prompts, completions, completion_ids, problem, **_):
        t = time.perf_counter()
        mine = [problems[i] for i in problem]
        results = [SimpleNamespace(token_ids=ids) for ids in completion_ids]
        scores = task.reward.score(task.samples(mine, results, 1))
        calls["n"] += len(results)
        calls["seconds"] += time.perf_counter() - t
        return [float(x) for x in scores.total]

    specroll_reward.calls = calls
    return specroll_reward


class StepTimer(TrainerCallback):
    """Wall seconds of each optimizer step (= RL step) and TRL's per-step logs."""

    def __init__(self) -> None:
        self.last = 0.0
        self.begin = 0.0
        self.step_s: list[float] = []
        self.inner_s: list[float] = []
        self.logs: dict[str, list[float]] = {k: [] for k in LOG_KEYS}

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        self.begin = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.step_s.append(round(now - self.last, 3))
        self.inner_s.append(round(now - self.begin, 3))
        self.last = now
        print(f"step {len(self.step_s)}: {self.step_s[-1]:.2f} s", flush=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        for k in LOG_KEYS:
            if logs and k in logs:
                self.logs[k].append(round(float(logs[k]), 4))


def grpo_config(cfg: TrainConfig, steps: int, out: str):
    """GRPOConfig for one generation of prompts_per_step x group_size sequences and one
    optimizer update per step, with the preset's sampling, loss and optimizer."""
    from trl import GRPOConfig

    per_step = cfg.data.prompts_per_step * cfg.data.group_size
    mb = micro_batch(cfg)
    r, loss, pol = cfg.rollout, cfg.loss, cfg.policy
    return GRPOConfig(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=mb,
        gradient_accumulation_steps=per_step // mb,
        steps_per_generation=per_step // mb,
        num_iterations=updates_per_step(cfg),
        num_generations=cfg.data.group_size,
        max_completion_length=r.max_new_tokens,
        temperature=r.temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        beta=loss.kl_coef,
        epsilon=loss.clip_low,
        epsilon_high=loss.clip_high,
        loss_type="dapo",  # token mean over the whole step's batch (loss.aggregation)
        scale_rewards="group" if loss.scale_advantages else "none",
        mask_truncated_completions=loss.mask_truncated,
        learning_rate=pol.lr,
        lr_scheduler_type="constant",
        warmup_steps=pol.warmup_steps,
        weight_decay=pol.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.99,  # specroll's learner
        max_grad_norm=pol.grad_clip,
        optim="adamw_torch_fused",  # specroll uses the fused AdamW where torch has one
        bf16=False,  # GRPOConfig defaults to bf16; specroll's default learner is fp32
        fp16=False,
        activation_checkpointing=False,  # GRPOConfig's default is on; specroll has none
        use_vllm=False,
        shuffle_dataset=False,  # the rows are already in specroll's step order
        seed=cfg.pipeline.seed,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_dropout=True,
        dataloader_num_workers=0,
    )


def updates_per_step(cfg: TrainConfig) -> int:
    """Passes over each generation: one (the preset's loss.updates_per_step is 1)."""
    if cfg.loss.updates_per_step != 1:
        raise ValueError("this benchmark times one optimizer update per step")
    return 1


def machine() -> dict:
    """CPU model (lscpu), torch threads, and the accelerator if any."""
    cpu = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        cpu = next(
            (ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")),
            cpu,
        )
    except (OSError, subprocess.CalledProcessError):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "gpu": gpu}


def versions() -> dict:
    import transformers
    import trl

    return {
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def summary(cfg: TrainConfig, steps: int, mb: int) -> dict:
    """The workload as run (what the JSON line's `config` holds)."""
    d, r = cfg.data, cfg.rollout
    return {
        "preset": PRESET,
        "model": cfg.policy.model,
        "steps": steps,
        "levels": list(d.levels),
        "pool": d.pool,
        "prompts_per_step": d.prompts_per_step,
        "group_size": d.group_size,
        "sequences_per_step": d.prompts_per_step * d.group_size,
        "micro_batch": mb,
        "max_new_tokens": r.max_new_tokens,
        "temperature": r.temperature,
        "top_k": r.top_k,
        "top_p": r.top_p,
        "lr": cfg.policy.lr,
        "reward": list(cfg.reward.functions),
        "loss": "dapo token mean, clip "
        f"{cfg.loss.clip_low}/{cfg.loss.clip_high}, beta {cfg.loss.kl_coef}",
        "dtype": "float32",
        "generation": "transformers generate (no vLLM)",
        "seed": cfg.pipeline.seed,
    }


def train(cfg: TrainConfig, args: argparse.Namespace, out: str) -> tuple[StepTimer, dict, str]:
    """Run TRL's GRPOTrainer for args.steps steps; the timer, reward calls, device."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    model_dir = hub.resolve(cfg.policy.model)
    tok = Tokenizer(model_dir)
    task = Task(cfg, tok)
    try:
        rows, problems = prompt_rows(cfg, task, tok, args.steps)
        reward = reward_function(task, problems)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        timer = StepTimer()
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=grpo_config(cfg, args.steps, out),
            train_dataset=Dataset.from_list(rows),
            processing_class=tok.hf,
            callbacks=[timer],
        )
        trainer.train()
        return timer, dict(reward.calls), str(trainer.args.device)
    finally:
        task.close()


def main() -> None:
    args = parse_args()
    cfg = workload(args)
    out = args.out or tempfile.mkdtemp(prefix="trl_grpo_")
    Path(out).mkdir(parents=True, exist_ok=True)
    timer, calls, device = train(cfg, args, out)
    later = timer.step_s[1:]
    result = {
        "benchmark": "trl_grpo",
        "step_s": timer.step_s,
        "median_step_s_2_to_n": round(statistics.median(later), 3) if later else None,
        "inner_step_s": timer.inner_s,
        "per_step_logs": timer.logs,
        "reward_calls": {"completions": calls["n"], "seconds": round(calls["seconds"], 3)},
        "versions": versions(),
        "machine": {**machine(), "device": device},
        "config": summary(cfg, args.steps, micro_batch(cfg)),
        "out": out,
    }
    line = json.dumps(result)
    (Path(out) / "result.json").write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
