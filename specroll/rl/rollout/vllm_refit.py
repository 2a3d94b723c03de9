"""New weights into a running vLLM engine, in place (the refit of every RL step).

The policy goes under its HF names through the worker's layerwise `reload_weights` (the
CPU backend repacks linear weights into oneDNN handles: copying into parameters changes
nothing, `load_weights` alone corrupts the model); a tied LM head is repacked after it
(it receives no tensor, so the reload leaves it computing with the old embedding). The
EAGLE-3 draft goes through the same layerwise steps on `get_draft_model()`, never with
`embed_tokens` (the module is the policy's). The prefix cache is reset after every
refit: its KV blocks were computed with the old weights.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from specroll.drafting.eagle3_io import hf_tensors
from specroll.model.config import ModelConfig
from specroll.model.weights import hf_state_dict
from specroll.rl.replica import State

HfTensors = list[tuple[str, torch.Tensor]]
"""(Hugging Face checkpoint name, tensor [out, in]) pairs: what vLLM's loaders read."""


def policy_tensors(cfg: ModelConfig, policy: State) -> HfTensors:
    """A specroll policy state (fused, [in, out]) under HF names ([out, in], q/k/v and
    gate/up split), contiguous, without copying the learner's module."""
    layers: list[dict[str, torch.Tensor]] = [{} for _ in range(cfg.num_layers)]
    for name, t in policy.items():
        if name.startswith("layers."):
            _, i, attr = name.split(".", 2)
            layers[int(i)][attr] = t
    view = SimpleNamespace(
        cfg=cfg,
        embed=policy["embed"],
        norm=policy["norm"],
        lm_head=policy.get("lm_head"),
        layers=[SimpleNamespace(**d) for d in layers],
    )
    return [(n, t.detach().contiguous()) for n, t in hf_state_dict(view)]  # type: ignore[arg-type]


def draft_tensors(cfg: Any, draft: State) -> HfTensors:
    """An EAGLE-3 head state under its checkpoint names (`eagle3_io`), as vLLM's
    `Eagle3LlamaForCausalLM.load_weights` reads them: no `t2d` (it skips it), no `d2t` for
    a full-vocabulary draft (vLLM then has no such parameter), never `embed_tokens`."""
    view = SimpleNamespace(cfg=cfg, **{k: v for k, v in draft.items() if "." not in k})
    out = hf_tensors(view)  # type: ignore[arg-type]
    out.pop("t2d")
    if cfg.draft_vocab_size == cfg.vocab_size:
        out.pop("d2t")
    assert not any("embed_tokens" in n for n in out)
    return list(out.items())


def _reload_draft(worker: Any, weights: HfTensors) -> None:
    """Runs on the vLLM worker (`collective_rpc`): the layerwise reload that
    `Worker.reload_weights` does for the target, on the speculative draft model."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    model = worker.get_draft_model()
    if model is None:
        raise RuntimeError("vLLM engine has no draft model to refit")
    vc = worker.vllm_config
    with set_current_vllm_config(vc):
        initialize_layerwise_reload(model)
        model.load_weights(weights)
        finalize_layerwise_reload(model, vc.speculative_config.draft_model_config)


def _repack_tied_head(worker: Any) -> None:
    """Runs on the vLLM worker after a policy reload of a tied-embedding model: the LM head
    shares the embedding's parameter but receives no tensor of its own, so the layerwise
    reload never re-runs its processing, and on CPU that processing is a prepacked GEMM
    copy of the weight (`dispatch_cpu_unquantized_gemm`): without this the head keeps
    computing logits with the old embedding (outputs silently wrong after a refit)."""
    head = worker.get_model().lm_head
    assert head.weight is worker.get_model().model.embed_tokens.weight  # still tied
    head.quant_method.process_weights_after_loading(head)


def reset_prefix_cache(llm: Any) -> None:
    """Drop the engine's cached prompt blocks (computed with the weights it had)."""
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache (requests running?)")


def refit(llm: Any, cfg: ModelConfig, policy: HfTensors, draft: HfTensors | None = None) -> None:
    """Load `policy` (and the EAGLE-3 `draft`) into the running engine `llm`, in place."""
    llm.collective_rpc(
        "reload_weights", kwargs=dict(weights_iterator=policy, is_checkpoint_format=True)
    )
    if cfg.tie_word_embeddings:
        llm.collective_rpc(_repack_tied_head)
    if draft is not None:
        llm.collective_rpc(_reload_draft, args=(draft,))
    reset_prefix_cache(llm)
