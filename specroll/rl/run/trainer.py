"""`specroll train`: the GRPO/DAPO step loop over a rollout backend and a learner host.

Each step runs the stages NeMo-RL names (paper §1.2), timed separately:

  gen      sample prompts, G rollouts each (speculative or plain, lossless either way),
           and any dynamic-sampling refill rounds (`run.refill`)
  reward   score the completions (`reward.functions`); group advantages (DAPO filters)
  logprob  the old log-probs: recomputed by the learner, or the engine's (`algo.old_logprobs`)
  train    policy update + online draft update from the same forward
  prepare  publish the new weights to the rollout side (versioned)

Everything random is a function of (seed, step): the prompts of step s are the task's
items s*P..s*P+P-1 and every rollout has its own counter-based seed, so a run resumed from
a checkpoint repeats the uninterrupted one exactly. Ctrl-C stops at the next stage
boundary, saves a checkpoint of the last completed step and exits; a second Ctrl-C exits
at once (`rundir.RunDir`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specroll.drafting.trainable import TrainableDraft, draft_config
from specroll.engine.request import Results
from specroll.model.transformer import Transformer
from specroll.rl.algo.advantages import result_advantages
from specroll.rl.algo.batch import Batch
from specroll.rl.algo.old_logprobs import OldLogprobs
from specroll.rl.budget import check_loaded
from specroll.rl.config import TrainConfig
from specroll.rl.errors import NonFiniteError, Stopped
from specroll.rl.learner import build_host
from specroll.rl.learner.build import with_learner_dtype
from specroll.rl.learner.schedule import lr_at
from specroll.rl.replica import Weights
from specroll.rl.rollout import build_rollout
from specroll.rl.run import adapters, checkpoint, export, rundir, samples, validation
from specroll.rl.run.checkpointing import Checkpointing
from specroll.rl.run.loggers import Loggers, check_installed, open_loggers
from specroll.rl.run.refill import StepGroups, refill
from specroll.rl.run.report import step_metrics, write_report
from specroll.rl.run.shadow import ShadowProbe
from specroll.rl.run.task import Task, step_seed
from specroll.rl.run.window import RolloutWindow
from specroll.tasks.rewards import RewardError


class Interrupted(Exception):
    """Raised at a stage boundary after Ctrl-C; the trainer saves and exits."""


class Trainer(Checkpointing):
    """The step loop over a rollout backend (`rollout.backend`) and a learner host
    (`learner.strategy`, `learner.placement`)."""

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
        check_installed(cfg)  # the loggers' packages, before any engine starts
        torch.manual_seed(cfg.pipeline.seed)
        self.task = Task(cfg, tok)
        """What each step samples: problems, requests and their seeds, rewards."""
        self.task.stop = self._check_stop  # a signal ends the reward stage at once
        policy = adapters.adapt(cfg, policy)  # lora.rank > 0: only its adapters train
        # a run built from Python meets the bounds the command line checks (`rl.budget`)
        check_loaded(cfg, policy.cfg, self.task.file_items)
        self.rollout = build_rollout(cfg, policy, draft, tok, log)
        if cfg.learner.placement == "auto" and cfg.learner_placement() == "ray":
            log("learner: in a Ray actor (learner.placement=auto follows rollout.backend=ray)")
        # learner.dtype auto: this machine's, measured once; the run's settings (and so
        # its checkpoints) keep 'auto', the learner and its old log-probs get the dtype
        resolved = with_learner_dtype(cfg, log)
        self.host = build_host(resolved, policy, draft)
        self.policy = policy
        self.window = RolloutWindow(
            self.rollout, self.task, cfg.pipeline.max_lag, cfg.pipeline.steps
        )
        self.shadow = ShadowProbe(cfg, self.rollout, self.task)
        """Plain decoding (and other drafters) of probed steps' requests, timed apart."""
        self.old_logprobs = OldLogprobs(resolved, log)
        self.draft_config = (
            {"kind": draft.kind, "config": draft_config(draft)} if draft is not None else None
        )
        """The draft's architecture, kept in checkpoints (`specroll export` rebuilds it)."""
        self.samples: list[dict] = []
        """The last step's sample completions (`log.samples`)."""
        self.step = 0
        self.run_dir: rundir.RunDir | None = None
        self.writer = checkpoint.Writer()
        """Writes the run's checkpoints in the background, one at a time."""
        weights = self.host.weights()
        self.refit_bytes = _local_bytes(Weights.of(policy, draft if cfg.draft.online else None))
        """What each refit carries to the rollout side (a LoRA policy's: its adapters,
        and the draft unless it is frozen), in bytes: the sizes of the tensors a host
        publishes."""
        self.rollout.update_weights(0, weights)

    def request_stop(self) -> None:
        """Stop at the next stage boundary, save a checkpoint and exit (what Ctrl-C does)."""
        if self.run_dir is not None:
            self.run_dir.request_stop()

    def _check_stop(self) -> None:
        if self.run_dir is not None and self.run_dir.stop_requested:
            raise Interrupted

    def run_step(self) -> dict:
        """One RL step, its five stages in turn; returns its metrics. A stop request ends
        the step after gen, reward or logprob (nothing is updated yet); once the update
        has run, the step is completed."""
        s = self.step
        torch.manual_seed(step_seed(self.cfg.pipeline.seed, s))
        problems = self.task.problems(s)
        t: dict[str, float] = {}
        results, lag, t["gen"] = self._gen()
        self._check_stop()
        groups = self._timed(t, "reward", self._reward, problems, results)
        t["gen"] += groups.seconds["gen"]  # refill rounds generate within the reward stage
        t["reward"] -= groups.seconds["gen"]
        self._check_stop()
        batch, masked = self._batch(groups)
        old = self._timed(t, "logprob", self._logprob, batch)
        self._check_stop()
        train_metrics = self._timed(t, "train", self._train, batch, old, masked)
        self._timed(t, "prepare", self._prepare)
        return self._metrics(t, problems, groups, lag, train_metrics)

    @staticmethod
    def _timed(times: dict[str, float], name: str, fn, *args):
        """`fn(*args)`, its seconds in times[name]."""
        t0 = time.perf_counter()
        out = fn(*args)
        times[name] = time.perf_counter() - t0
        return out

    def _gen(self) -> tuple[Results, dict[int, int], float]:
        """The step's rollouts, {lag: samples} and the seconds the learner waited for them
        (async: only the exposed part), with the shadow probe's runs around it, timed
        apart (`ShadowProbe.around`)."""
        s = self.step
        reqs = self.task.step_requests(s)
        with self.shadow.around(s, reqs):
            t0 = time.perf_counter()
            results, lag = self.window.take(s, reqs)
            seconds = time.perf_counter() - t0
        return results, lag, seconds

    def _reward(self, problems: list, results: Results) -> StepGroups:
        """Rewards, advantages and the groups trained on (with dynamic sampling: the
        refill rounds too); the step's sample completions for `log.samples`."""
        cfg, s, G = self.cfg, self.step, self.cfg.data.group_size
        scores = self.task.score(problems, results, G)  # a failing reward function stops here
        if s == 0 and not bool(scores.total.any()):  # no signal: say why, once
            self.log(f"warning: {self.task.zero_reward_hint(problems, results, G)}")
        self.samples = samples.rows(
            s + 1,
            cfg.log.samples,
            problems,
            results,
            scores.total,
            self.tok,
            scores.parts,
            speculative=self.rollout.speculative,
        )
        max_new = cfg.rollout.max_new_tokens
        adv, keep = result_advantages(scores.total, results, max_new, cfg.loss)
        groups = StepGroups(problems, results, scores, adv, keep)
        if cfg.loss.max_refill_rounds:  # dynamic sampling: more groups while too few count
            groups = refill(cfg, self.task, s, self.rollout.generate, groups)
        return groups

    def _batch(self, groups: StepGroups) -> tuple[tuple[Batch, torch.Tensor] | None, int | None]:
        """The rollouts trained on — kept groups, less cut responses with overlong
        filtering (`loss.mask_truncated`) — and which of them the current policy generated
        ([N] bool), None when none is left; and how many cut responses overlong filtering
        masked (None: it is off)."""
        G, results = self.cfg.data.group_size, groups.results
        rows = [i for i in range(len(results)) if bool(groups.keep[i // G])]
        masked = None
        if self.cfg.loss.mask_truncated:  # overlong filtering: a cut response adds no loss
            masked = sum(results[i].finish_reason != "stop" for i in rows)
            rows = [i for i in rows if results[i].finish_reason == "stop"]
        if not rows:
            return None, masked
        batch = Batch.from_results([results[i] for i in rows], groups.advantages.view(-1)[rows])
        fresh = torch.tensor([results[i].policy_version == self.step for i in rows], device="cpu")
        return (batch, fresh), masked

    def _logprob(self, batch: tuple[Batch, torch.Tensor] | None) -> tuple | None:
        """The old (and reference) log-probs of the batch and their stats
        (`algo.old_logprobs`)."""
        if batch is None:
            return None
        return self.old_logprobs(self.host.logprobs, *batch, self.step)

    def _train(
        self, batch: tuple[Batch, torch.Tensor] | None, old: tuple | None, masked: int | None
    ) -> dict:
        """The policy and draft update; the learner's metrics (with `masked`, `_batch`'s)."""
        steps = self.cfg.pipeline.steps
        m: dict = {"lr": lr_at(self.cfg.policy, self.step, steps, self.cfg.policy_lr())}
        if masked is not None:
            m["masked_truncated"] = masked
        if batch is not None:
            old_lp, ref, stats = old
            m.update(stats)
            m.update(self.host.train(batch[0], old_lp, ref, m["lr"]))
        return m

    def _prepare(self) -> None:
        """Publish the new weights to the rollout side (version step + 1)."""
        self.step += 1
        weights = self.host.weights()
        if not self.cfg.draft.online:  # a frozen draft: the rollout side keeps the one it has
            weights = dataclasses.replace(weights, draft=None)
        self.rollout.update_weights(self.step, weights)

    def _metrics(
        self, t: dict, problems: list, groups: StepGroups, lag: dict, train_metrics: dict
    ) -> dict:
        """The step's metrics: stages, generation, rewards (each function's over every
        refill round), speculation and the shadow probe's."""
        cfg, results = self.cfg, groups.results
        m = step_metrics(
            self.step,
            t,
            results,
            groups.rewards,
            groups.keep,
            lag,
            train_metrics,
            dropped=self.window.dropped,
            restarts=self.rollout.restarts,
            refill=groups if cfg.loss.max_refill_rounds else None,
        )
        m.update(groups.scores.metrics())  # reward/<function>: each function's mean
        m["refit_bytes"] = self.refit_bytes
        n_tok = sum(len(r.token_ids) for r in results)
        m.update(self.shadow.metrics(problems, cfg.data.group_size, t["gen"], n_tok))
        return m

    def validate(self) -> dict[str, float]:
        """The current policy's validation metrics (`validation.validate`)."""
        return validation.validate(self.task, self.rollout.generate, first=self.step == 0)

    def close(self) -> None:
        """Stop the rollout workers and the learner's processes or actors; in-flight
        asynchronous rollouts are discarded."""
        self.window.clear()
        self.rollout.close()
        self.host.close()
        self.task.close()

    def run(
        self,
        resume: bool = False,
        on_step: Callable[[dict], None] | None = None,
        overwrite: bool = False,
        plan: rundir.Plan | None = None,
    ) -> list[dict]:
        """Run to `pipeline.steps`; metrics go to out_dir/metrics.jsonl.

        plan: what `rundir.check` decided for out_dir (checked here when not given, from
        `resume` / `overwrite`); a finished run is left as it is, one whose end (export,
        report) was cut short gets it written."""
        cfg = self.cfg
        if plan is None:
            plan = rundir.check(self.out, cfg.to_dict(), cfg.pipeline.steps, resume, overwrite)
        if plan.action == "finished":
            self.log(plan.finished_message(self.out, cfg.pipeline.steps))
            return []
        for line in plan.skipped:
            self.log(f"warning: {line}")
        self.run_dir = run_dir = rundir.RunDir(self.out, cfg.to_dict(), plan, self.log)
        run_dir.settle = self._settle
        if plan.action in ("resume", "finalize"):
            self.restore(checkpoint.load(plan.checkpoint))
            self.log(f"resumed from {plan.checkpoint} (step {self.step})")
        run_dir.open(self.step)
        history: list[dict] = []
        loggers = Loggers([])
        try:
            loggers = open_loggers(cfg, self.out, run_dir.run_id)
            with run_dir:
                if plan.action != "finalize":
                    self._loop(run_dir, loggers, history, on_step)
                    self.save_checkpoint()
                self.host.export(self.out.resolve())
                rollout = dataclasses.asdict(cfg.rollout)
                export.finish(self.out / "policy", self.tok.hf, rollout, cfg.pipeline.export_dtype)
                write_report(self.out, run_dir.rows(), cfg)
        except Interrupted:
            path = self.save_checkpoint()
            raise Stopped(run_dir.signum, f"saved {path}; continue with --resume") from None
        except NonFiniteError as e:
            raise NonFiniteError(f"step {self.step + 1}: {e}; {self._kept()}") from None
        except RewardError as e:  # in the reward stage: this step changed nothing yet
            first, nl, traceback = str(e).partition("\n")
            path = self.save_checkpoint()
            raise RewardError(
                f"step {self.step + 1}: {first}; no update was applied, the weights of step "
                f"{self.step} are saved in {path}: fix the function, then continue with "
                f"--resume{nl}{traceback}"
            ) from None
        finally:
            self._settle()
            run_dir.close()
            loggers.close()
            self.task.close()  # the reward worker: a later call starts it again
        return history

    def _loop(self, run_dir: rundir.RunDir, loggers: Loggers, history: list, on_step) -> None:
        """Steps until `pipeline.steps`: validation, metrics, samples, checkpoints, exports."""
        cfg = self.cfg
        # the starting validation reward, for reference (once: a run stopped after it and resumed
        # from its step-0 checkpoint has it logged already)
        if self.step == 0 and cfg.data.val_size and not run_dir.rows():
            m0 = {"step": 0, **self.validate()}
            run_dir.append(m0)
            loggers.step(m0)
            history.append(m0)
            self.log(f"step 0: validation reward (mean) {m0['val_accuracy']:.3f}")
        while self.step < cfg.pipeline.steps:
            m = self.run_step()
            last = self.step == cfg.pipeline.steps
            if cfg.data.val_size and (self.step % cfg.data.val_every == 0 or last):
                m.update(self.validate())
            run_dir.append_samples(self.samples)
            loggers.samples(self.step, self.samples)
            run_dir.append(m)
            loggers.step(m)
            history.append(m)
            if on_step:
                on_step(m)
            every = cfg.pipeline.checkpoint_every
            if every and self.step % every == 0 and not last:
                self.save_checkpoint(wait=False)
            every = cfg.pipeline.export_every
            if every and self.step % every == 0:
                rollout = dataclasses.asdict(cfg.rollout)
                dtype = cfg.pipeline.export_dtype
                export.step_export(self.host, self.tok.hf, self.out, self.step, rollout, dtype)
            self._check_stop()


def _local_bytes(w: Weights) -> int:
    """Bytes of the tensors of a (local) weights handle."""
    parts = [d for d in (w.policy, w.draft) if d]
    return sum(t.numel() * t.element_size() for d in parts for t in d.values())
