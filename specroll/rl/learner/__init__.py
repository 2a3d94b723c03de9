"""The learner: the update itself (`learner`), how it is built (`build`), and the hosts it
runs in behind one interface (`host`): this process (`single`), a Ray actor (`ray`), or N
FSDP2 ranks as local processes or Ray actors (`fsdp`)."""

from __future__ import annotations

from specroll.drafting.trainable import TrainableDraft
from specroll.model.transformer import Transformer
from specroll.rl.config import TrainConfig
from specroll.rl.errors import LearnerRankError
from specroll.rl.learner.host import LearnerHost

__all__ = ["LearnerHost", "LearnerRankError", "build_host"]


def build_host(cfg: TrainConfig, policy: Transformer, draft: TrainableDraft | None) -> LearnerHost:
    """The learner of the run where `learner.strategy` and `learner.placement` put it:
    one process or `learner.ranks` FSDP ranks, in the driver's machine (local processes)
    or on Ray (actors, in one placement group for FSDP ranks). The learner starts from
    `policy` and `draft` (the single local host trains those very objects). Each host is
    imported when chosen: the FSDP ones import torch.distributed.checkpoint, a second of
    a one-process run's start."""
    on_ray = cfg.learner_placement() == "ray"
    if cfg.learner.strategy == "fsdp":
        if on_ray:
            from specroll.rl.learner.fsdp.ray import RayFSDPLearnerHost as Host
        else:
            from specroll.rl.learner.fsdp.host import FSDPLearnerHost as Host
    elif on_ray:
        from specroll.rl.learner.ray import RayLearnerHost as Host
    else:
        from specroll.rl.learner.single import LocalLearnerHost as Host
    return Host(cfg, policy, draft)
