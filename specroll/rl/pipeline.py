"""`specroll train`: the synchronous GRPO/DAPO pipeline with speculative rollouts.

Each step runs the stages NeMo-RL names (paper §1.2), timed separately:

  gen      sample prompts, G rollouts each (speculative or plain, lossless either way)
  reward   math-verify the answers; group advantages (DAPO filters)
  logprob  recompute the tempered log-probs with the learner's policy (and reference)
  train    policy update + online draft update from the same forward
  prepare  publish the new weights to the engine (versioned)

Everything random is a function of (seed, step): the prompts of step s are the task
generator's items s*P..s*P+P-1 and every rollout has its own counter-based seed, so a
run resumed from a checkpoint repeats the uninterrupted one exactly. Ctrl-C stops at the
next stage boundary, saves a checkpoint of the last completed step and exits; a second
Ctrl-C exits at once.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specroll.drafters.trainable import TrainableDraft
from specroll.engine.profile import PROFILE_PROMPTS_SEED
from specroll.engine.request import Request
from specroll.model.transformer import Transformer
from specroll.rl import checkpoint, rundir, tensorboard
from specroll.rl import loss as L
from specroll.rl.backends import build_rollout
from specroll.rl.batch import Batch
from specroll.rl.config import TrainConfig
from specroll.rl.learner_host import build_host
from specroll.rl.mismatch import logprob_tolerance, mismatch_stats
from specroll.rl.rollout import Pending
from specroll.rl.workload import VALIDATION_SEED, Workload, step_seed
from specroll.tasks.sets import encode, math_problems


def engine_logprobs_usable(cfg: TrainConfig) -> bool:
    """Whether `learner.recompute_logprobs: auto` may take the engine's log-probs as the
    old ones: synchronous (every sample on-policy), fp32 on both sides (bf16 log-probs
    differ by far more than float rounding), and no reference pass needed anyway (KL)."""
    return (
        cfg.learner.recompute_logprobs == "auto"
        and cfg.pipeline.max_lag == 0
        and cfg.rollout.dtype == cfg.learner.dtype == "float32"
        and cfg.loss.kl_coef == 0
    )


class Interrupted(Exception):
    """Raised at a stage boundary after Ctrl-C; the pipeline saves and exits."""


class Trainer:
    """The step loop over a rollout backend (`rollout.backend`) and a learner host."""

    def __init__(
        self,
        cfg: TrainConfig,
        policy: Transformer,
        tok,
        draft: TrainableDraft | None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.cfg, self.tok, self.log = cfg, tok, log
        self.out = Path(cfg.pipeline.out_dir)
        torch.manual_seed(cfg.pipeline.seed)
        self.policy = policy  # with the Ray learner: the initial weights (the actor trains)
        self.draft = draft
        # the prompts a backend measures its hardware profile on (adaptive depth)
        prompts = [encode(tok, p) for p in math_problems(8, seed=PROFILE_PROMPTS_SEED)]
        self.rollout = build_rollout(cfg, policy, draft, prompts, log)
        self.host = build_host(cfg, policy, draft)
        self.rollout.publish(0, *self.host.weights())
        self._inflight: dict[int, Pending] = {}
        self.step = 0
        self.run_id = ""
        """The id of the run that owns out_dir (stamped on every checkpoint)."""
        self.dropped = 0
        """Samples dropped for being more than pipeline.max_lag versions old."""
        self._stop = False
        self.work = Workload(cfg, tok)
        """What each step samples: problems, requests and their seeds, rewards."""
        self.logprob_fallback = False
        """An agreement check failed: recompute the old log-probs from then on (kept in
        checkpoints)."""
        self._checked = False  # this process has run an agreement check

    def _rollouts(self, s: int, reqs: list[Request]):
        """Step s's rollouts and {lag: samples}.

        Synchronous (max_lag 0): generate now with the current weights (version s).
        Asynchronous: keep steps s..s+max_lag submitted — a step is submitted with the
        weights current at submission, so its samples are at most max_lag versions old
        when trained on — and wait for step s's. Samples older than max_lag (possible
        only after a resume or from a foreign submission) are dropped, counted, and
        their step regenerated with the current weights.
        """
        L = self.cfg.pipeline.max_lag
        for t in range(s, min(s + L, self.cfg.pipeline.steps - 1) + 1):
            if t not in self._inflight:
                self._inflight[t] = self.rollout.submit(
                    reqs if t == s else self.work.step_requests(t)
                )
        results, spec = self._inflight.pop(s).result()
        stale = sum(s - r.policy_version > L for r in results)
        if stale:
            self.dropped += stale
            results, spec = self.rollout.generate(reqs)
        lag: dict[int, int] = {}
        for r in results:
            want_draft = r.policy_version if self.rollout.speculative else None
            if r.draft_version != want_draft or not 0 <= s - r.policy_version <= L:
                raise RuntimeError(
                    f"step {s}: a rollout was generated with policy/draft versions "
                    f"{r.policy_version}/{r.draft_version}; expected policy in "
                    f"[{s - L}, {s}] and the draft of the same version"
                )
            lag[s - r.policy_version] = lag.get(s - r.policy_version, 0) + 1
        return results, spec, lag

    def _shadow(self, reqs: list[Request]) -> tuple[float, int]:
        """(seconds, tokens) of generating `reqs` without speculation (results discarded)."""
        t0 = time.perf_counter()
        results, _ = self.rollout.generate(reqs, plain=True)
        return time.perf_counter() - t0, sum(len(r.token_ids) for r in results)

    def _old_logprobs(self, batch: Batch, fresh: torch.Tensor, s: int):
        """Stage `logprob`: (old [N, T], ref [N, T] or None, metrics).

        Recomputed by the learner, or (`learner.recompute_logprobs: auto`, see
        `engine_logprobs_usable`) the engine's own, which equal the learner's to float
        rounding in fp32: then the learner recomputes only on the first step this process
        runs and every `learner.check_every` steps, as a check. A check that passes still
        trains on the engine's log-probs, so a run does not depend on when it checked (a
        resumed run repeats the uninterrupted one); one that fails (mismatch above the
        stated bound, `rl.mismatch`) switches the run to recomputation, with a warning.
        The mismatch statistics are those of every recomputation (on-policy tokens)."""
        cfg = self.cfg
        use_engine = engine_logprobs_usable(cfg) and not self.logprob_fallback
        check = not self._checked or s % cfg.learner.check_every == 0
        engine = batch.behaviour_logp * batch.response_mask
        if use_engine and not check:
            none = mismatch_stats(engine, engine, torch.zeros_like(batch.response_mask))
            return engine, None, {**none, "logprob_source": "engine", "logprob_check": None}
        old, ref = self.host.logprobs(batch)
        self._checked = True
        stats = mismatch_stats(batch.behaviour_logp, old, batch.response_mask & fresh[:, None])
        worst = stats["logprob_mismatch_max"]
        fp32 = cfg.rollout.dtype == cfg.learner.dtype == "float32"
        bound = logprob_tolerance(cfg.rollout.temperature)
        agree = worst is None or worst <= bound
        if fp32 and not agree:
            self.log(
                f"warning: step {s + 1}: engine vs learner log-probs differ by {worst:.2e}, "
                f"above the stated bound {bound:.2e} (rl.mismatch): check weights and dtype"
                + ("; recomputing the log-probs from now on" if use_engine else "")
            )
        if not use_engine:
            return old, ref, {**stats, "logprob_source": "learner", "logprob_check": None}
        if agree:  # checked: train on the engine's, as on the steps between checks
            return engine, ref, {**stats, "logprob_source": "engine", "logprob_check": True}
        self.logprob_fallback = True
        return old, ref, {**stats, "logprob_source": "learner", "logprob_check": False}

    # ------------------------------------------------------------------ step

    def _check_stop(self) -> None:
        if self._stop:
            raise Interrupted

    def run_step(self) -> dict:
        """One RL step; returns its metrics."""
        cfg, s = self.cfg, self.step
        d = cfg.data
        G = d.group_size
        t = {"prepare": 0.0}
        torch.manual_seed(step_seed(cfg.pipeline.seed, s))

        problems = self.work.problems(s)
        reqs = self.work.step_requests(s)
        every = cfg.pipeline.shadow_every
        shadow = every and s % every == 0 and self.rollout.speculative
        shadow = shadow and not cfg.pipeline.max_lag
        # plain decoding of the same requests on the same weights; every other time it
        # runs first, so that neither side always comes right after the learner's update
        shadow_first = shadow and (s // every) % 2 == 1
        plain_run = self._shadow(reqs) if shadow_first else None  # (seconds, tokens)
        t0 = time.perf_counter()
        results, spec, lag = self._rollouts(s, reqs)
        t["gen"] = time.perf_counter() - t0  # async: only the exposed part (learner waits)
        if shadow and not shadow_first:
            plain_run = self._shadow(reqs)
        self._check_stop()

        t0 = time.perf_counter()
        rewards = self.work.rewards(problems, results, G)  # [P, G]
        lengths_resp = torch.tensor([len(r.token_ids) for r in results], device="cpu")
        adv, keep = L.step_advantages(rewards, lengths_resp, cfg.rollout.max_new_tokens, cfg.loss)
        t["reward"] = time.perf_counter() - t0

        metrics: dict = {}
        rows = [i for i in range(len(results)) if bool(keep[i // G])]
        t["logprob"] = t["train"] = 0.0
        if rows:
            batch = Batch.from_results([results[i] for i in rows], adv.view(-1)[rows])
            fresh = torch.tensor([results[i].policy_version == s for i in rows], device="cpu")
            t0 = time.perf_counter()
            old, ref, stats = self._old_logprobs(batch, fresh, s)
            metrics.update(stats)
            t["logprob"] = time.perf_counter() - t0
            self._check_stop()
            t0 = time.perf_counter()
            metrics.update(self.host.train(batch, old, ref))
            t["train"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        self.step = s + 1
        self.rollout.publish(self.step, *self.host.weights())
        t["prepare"] = time.perf_counter() - t0

        n_tok = int(lengths_resp.sum())
        total = sum(t.values())
        metrics.update(
            step=self.step,
            time={k: round(v, 3) for k, v in t.items()},
            step_s=round(total, 3),
            gen_tokens=n_tok,
            gen_tok_s=round(n_tok / max(spec.total_s, 1e-9), 2),
            gen_busy_s=round(spec.total_s, 3),  # generation wall time (slowest worker)
            exposed_gen_s=round(t["gen"], 3),  # what the learner waited for
            lag={str(k): v for k, v in sorted(lag.items())},
            dropped_samples=self.dropped,
            worker_restarts=self.rollout.restarts,
            reward=round(float(rewards.mean()), 4),
            accuracy=round(float((rewards > 0).float().mean()), 4),
            response_len_mean=round(float(lengths_resp.float().mean()), 2),
            response_len_max=int(lengths_resp.max()),
            response_lengths=lengths_resp.tolist(),  # `specroll simulate --lengths-from`
            groups_kept=int(keep.sum()),
            groups=len(problems),
            acceptance_length=round(spec.acceptance_length, 4) if spec.drafts else None,
            per_position=[round(x, 4) for x in spec.per_position] if spec.drafts else None,
            depth_hist=list(spec.depth_hist),  # decode iterations by draft depth (0 = plain)
            policy_version=self.step,
        )
        if plain_run is not None:
            # speculative and plain decoding draw the same distribution, not the same
            # samples: the two runs' lengths differ, so the time ratio (the step's
            # saving) moves with them, and the token-rate ratio measures the decoding
            shadow_s, shadow_tok = plain_run
            metrics["shadow_ar_gen_s"] = round(shadow_s, 3)
            metrics["shadow_ar_gen_tokens"] = shadow_tok
            metrics["gen_speedup"] = round(shadow_s / t["gen"], 4)
            metrics["gen_rate_speedup"] = round((n_tok / t["gen"]) / (shadow_tok / shadow_s), 4)
        return metrics

    @torch.no_grad()
    def validate(self) -> float:
        """Accuracy (one sample per held-out prompt, fixed seeds) of the current policy."""
        probs = self.work.validation()
        if not probs:
            return float("nan")
        results, _ = self.rollout.generate(self.work.requests(probs, 1, VALIDATION_SEED))
        return round(float(self.work.rewards(probs, results, 1).mean()), 4)

    # ------------------------------------------------------------------ state

    def state(self) -> dict:
        return {
            "config": self.cfg.to_dict(),
            "logprob_fallback": self.logprob_fallback,
            **self.host.state(),
        }

    def restore(self, state: dict) -> None:
        problem = rundir.config_mismatch(self.cfg.to_dict(), state["config"])
        if problem:
            raise ValueError(problem)
        self.host.restore(state)
        self.step = state["step"]
        self.logprob_fallback = bool(state.get("logprob_fallback", False))
        self.rollout.publish(self.step, *self.host.weights())

    def close(self) -> None:
        """Stop the rollout workers and the learner actor (Ray); in-flight async rollouts
        are discarded."""
        self._inflight.clear()
        self.rollout.close()
        self.host.close()

    def save_checkpoint(self) -> Path:
        return checkpoint.save(
            self.out / "checkpoints",
            self.step,
            self.state(),
            self.cfg.pipeline.keep_checkpoints,
            run_id=self.run_id,
            write=getattr(self.host, "save_sharded", None),
        )

    # ------------------------------------------------------------------ loop

    def run(
        self,
        resume: bool = False,
        on_step: Callable[[dict], None] | None = None,
        overwrite: bool = False,
    ) -> list[dict]:
        """Run to `pipeline.steps`; metrics go to out_dir/metrics.jsonl.

        The directory must be free (or `overwrite`), or hold this run's checkpoint when
        `resume` (see `rl.rundir`); a finished run is left as it is.
        """
        cfg = self.cfg
        plan = rundir.check(self.out, cfg.to_dict(), cfg.pipeline.steps, resume, overwrite)
        if plan.action == "finished":
            self.log(plan.finished_message(self.out, cfg.pipeline.steps))
            return []
        self.run_id = rundir.start(self.out, cfg.to_dict(), plan)
        metrics_path = self.out / "metrics.jsonl"
        if plan.action == "resume":
            self.restore(checkpoint.load(plan.checkpoint))
            self.log(f"resumed from {plan.checkpoint} (step {self.step})")
            kept = [
                line
                for line in (metrics_path.read_text().splitlines() if metrics_path.exists() else [])
                if json.loads(line).get("step", 0) <= self.step
            ]
            metrics_path.write_text("".join(line + "\n" for line in kept))
        else:
            metrics_path.write_text("")
        writer = tensorboard.writer(self.out) if cfg.log.tensorboard else None
        history: list[dict] = []
        previous = signal.getsignal(signal.SIGINT)

        def on_sigint(signum, frame):  # first Ctrl-C: stop at the next boundary
            if self._stop:
                raise KeyboardInterrupt
            self._stop = True
            self.log("Ctrl-C: finishing the current stage, then saving a checkpoint")

        signal.signal(signal.SIGINT, on_sigint)
        try:
            if self.step == 0 and cfg.data.val_size:  # the starting accuracy, for reference
                m0 = {"step": 0, "val_accuracy": self.validate()}
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(m0) + "\n")
                history.append(m0)
                self.log(f"step 0: validation accuracy {m0['val_accuracy']:.3f}")
            while self.step < cfg.pipeline.steps:
                m = self.run_step()
                if cfg.data.val_size and (
                    self.step % cfg.data.val_every == 0 or self.step == cfg.pipeline.steps
                ):
                    m["val_accuracy"] = self.validate()
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(m) + "\n")
                if writer is not None:
                    tensorboard.write(writer, m)
                history.append(m)
                if on_step:
                    on_step(m)
                every = cfg.pipeline.checkpoint_every
                if every and self.step % every == 0 and self.step < cfg.pipeline.steps:
                    self.save_checkpoint()
                self._check_stop()
        except Interrupted:
            path = self.save_checkpoint()
            self.log(f"saved {path}; continue with --resume")
            raise KeyboardInterrupt from None
        finally:
            signal.signal(signal.SIGINT, previous)
            if writer is not None:
                writer.close()
        self.save_checkpoint()
        self._export()
        from specroll.rl.report import write_report

        lines = metrics_path.read_text().splitlines()
        write_report(self.out, [json.loads(x) for x in lines], cfg)
        return history

    def _export(self) -> None:
        """The trained policy (HF dir, with tokenizer) and draft (vLLM EAGLE-3 layout)."""
        self.host.export(self.out.resolve())
        self.tok.hf.save_pretrained(str(self.out / "policy"))
