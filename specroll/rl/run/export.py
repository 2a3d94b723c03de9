"""A policy as a Hugging Face directory that transformers and vLLM load as-is.

An export holds config.json, the weights (`model.safetensors`, or shards
`model-0000i-of-0000n.safetensors` with `model.safetensors.index.json` once they pass the
shard size), the tokenizer, `generation_config.json` (the run's sampling: temperature,
response budget, stop ids) and, in `draft/`, the draft in its serving layout (EAGLE-3:
vLLM's). The run's final `policy/` gets the same files (its draft stays beside it, in
`draft/`), and so does every `pipeline.export_every`-th step, in
`out_dir/exports/step-NNNNNN` (all kept: an export is an artefact to evaluate or serve,
unlike the rolling checkpoints, which exist to resume). `specroll export` writes one from
a run or a checkpoint (`export_source`).

Every export is written beside its destination and renamed into place, so a reader (or
a crash) never sees half of one; a write that fails (a full disk, a file-size limit)
removes what it wrote and says which file, in one line (`ExportError`). Weights are
written fp32 by `save_model` first and then cast and sharded here (`finish`), so one code
path serves every learner (a sharded learner's rank 0 gathers the fp32 policy; see
`learner/`).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specroll import outputs
from specroll.drafting.trainable import TrainableDraft, save_draft
from specroll.model import peft_io
from specroll.model.transformer import Transformer
from specroll.model.weights import save_model
from specroll.rl.errors import RunError

DEFAULT_SHARD_SIZE = "2GB"
"""Largest weight file of an export (`--max-shard-size`); bigger policies are sharded."""
INDEX = "model.safetensors.index.json"
"""The shard index of a sharded export (tensor name -> file)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Export weight dtypes by name (`pipeline.export_dtype`, `--dtype`)."""
WRITES = (*outputs.HF_DIR_FILES, "draft", "adapter_config.json")
"""What an export directory holds (what `--overwrite` may replace)."""
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


class ExportError(RunError):
    """An export could not be written (nothing of it is left in its destination)."""


def _write_failed(dest: Path, what: str, e: BaseException) -> ExportError:
    """The one line for a write of `what` (the files of one stage of `write`) into the
    export `dest` that failed (safetensors' errors name no file: `what` does)."""
    name = getattr(e, "filename", None)
    where = Path(name).name if name else what
    why = getattr(e, "strerror", None) or str(e).strip().splitlines()[0]
    return ExportError(
        f"could not write the export {dest}: {where}: {why}; {dest} is left as it was"
    )


def parse_size(text: str | int, what: str = "--max-shard-size") -> int:
    """Bytes of a size such as 2GB, 500MB, 64KB or 1000000; ValueError naming `what`."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?B?)\s*", str(text).upper())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{what} must be a size such as 2GB, 500MB or a byte count, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def generation_config(hf_config: dict, tok_hf, rollout: dict) -> dict:
    """generation_config.json: sampling as the run's rollouts sampled (temperature, no
    top-k or top-p, the response budget) and the model's stop ids."""
    return {
        "bos_token_id": hf_config.get("bos_token_id"),
        "eos_token_id": hf_config.get("eos_token_id"),
        "pad_token_id": getattr(tok_hf, "pad_token_id", None),
        "do_sample": True,
        "temperature": float(rollout["temperature"]),
        "top_k": 0,
        "top_p": 1.0,
        "max_new_tokens": int(rollout["max_new_tokens"]),
    }


def finish(
    policy_dir: Path,
    tok_hf,
    rollout: dict,
    dtype: str = "float32",
    max_shard: int | str = DEFAULT_SHARD_SIZE,
) -> None:
    """Turn `save_model`'s directory (config.json + fp32 model.safetensors) into an export:
    weights in `dtype`, sharded with an index above `max_shard` bytes, the tokenizer, and
    generation_config.json. rollout: the run's `rollout` settings (a dict)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    policy_dir = Path(policy_dir)
    single = policy_dir / "model.safetensors"
    # shards of an earlier export here (a resumed run's policy/, another dtype) would be
    # read beside the new weights
    for stale in [*policy_dir.glob("model-*-of-*.safetensors"), policy_dir / INDEX]:
        stale.unlink(missing_ok=True)
    tensors = {k: v.to(DTYPES[dtype]) for k, v in load_file(single).items()}
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=parse_size(max_shard))
    if split.is_sharded or dtype != "float32":
        single.unlink()
        for name, keys in split.filename_to_tensors.items():
            with outputs.atomic_path(policy_dir / name) as tmp:
                save_file({k: tensors[k].contiguous() for k in keys}, tmp, {"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        outputs.write_text(policy_dir / INDEX, json.dumps(index, indent=2) + "\n")
    hf = json.loads((policy_dir / "config.json").read_text())
    hf["torch_dtype"] = hf["dtype"] = dtype
    outputs.write_text(policy_dir / "config.json", json.dumps(hf, indent=2) + "\n")
    tok_hf.save_pretrained(str(policy_dir))
    gen = generation_config(hf, tok_hf, rollout)
    outputs.write_text(policy_dir / "generation_config.json", json.dumps(gen, indent=2) + "\n")


def check_out(dest: str | Path, overwrite: bool) -> Path:
    """`dest` as an export's destination, before any work: writable, and either absent,
    empty, or (with `overwrite`) holding nothing but an export's files."""
    dest = outputs.check_dir(dest, "--out")
    if not dest.is_dir() or not any(dest.iterdir()):
        return dest
    if not overwrite:
        raise ValueError(
            f"--out={dest} exists; choose another --out, or add --overwrite to replace it"
        )
    foreign = [p.name for p in sorted(dest.iterdir()) if not any(p.match(x) for x in WRITES)]
    if foreign:
        raise ValueError(
            f"--overwrite replaces only an export's files, and {dest} also holds "
            f"{', '.join(foreign[:3])}: move them, or choose another --out"
        )
    return dest


def stage_dir(dest: Path) -> Path:
    """An empty directory beside `dest` to write its export into (`publish` renames it)."""
    stage = dest.parent / f".tmp-{dest.name}"
    shutil.rmtree(stage, ignore_errors=True)  # left by a process killed mid-write
    stage.mkdir(parents=True)
    return stage


def publish(stage: Path, dest: Path) -> Path:
    """Put the finished `stage` in `dest`'s place (replacing an older export there)."""
    old = dest.parent / f".old-{dest.name}"
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        dest.rename(old)
    stage.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest


def write(
    policy: Transformer,
    draft: TrainableDraft | None,
    tok_hf,
    rollout: dict,
    dest: Path,
    dtype: str = "float32",
    max_shard: int | str = DEFAULT_SHARD_SIZE,
) -> Path:
    """The export of `policy` (and `draft`, in dest/draft) in `dest`, written whole."""
    dest = Path(dest)
    stage = stage_dir(dest)
    what = "model.safetensors"
    try:
        save_model(policy, stage)
        what = f"the {dtype} weights, the tokenizer and generation_config.json"
        finish(stage, tok_hf, rollout, dtype, max_shard)
        what = "draft/"
        if draft is not None:
            save_draft(draft, stage / "draft")
    except (OSError, SafetensorError) as e:  # a full disk, a file-size limit
        shutil.rmtree(stage, ignore_errors=True)
        if what == "model.safetensors" and isinstance(e, OSError):
            what = "config.json"  # save_model's other file (its weights fail as Safetensor)
        raise _write_failed(dest, what, e) from None
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return publish(stage, dest)


def write_adapter(policy: Transformer, dest: Path, base: str) -> Path:
    """`policy`'s LoRA adapters as a PEFT adapter directory in `dest` (`--peft`), written
    whole; ExportError for a policy trained without adapters."""
    if policy.lora_spec is None:
        raise ExportError(
            "--peft: this run trained the whole policy (lora.rank 0): it has no adapters; "
            "export the merged model without --peft"
        )
    dest = Path(dest)
    stage = stage_dir(dest)
    try:
        peft_io.save(policy, stage, base)
    except (OSError, SafetensorError) as e:
        shutil.rmtree(stage, ignore_errors=True)
        raise _write_failed(dest, peft_io.WEIGHTS, e) from None
    return publish(stage, dest)


def step_export(host, tok_hf, out: Path, step: int, rollout: dict, dtype: str) -> Path:
    """`out/exports/step-NNNNNN` from a learner host (`pipeline.export_every`)."""
    dest = Path(out).resolve() / "exports" / f"step-{step:06d}"
    stage = stage_dir(dest)  # host.export writes policy/ and draft/ into it
    try:
        host.export(stage)
        finish(stage / "policy", tok_hf, rollout, dtype)
    except (OSError, SafetensorError) as e:  # a full disk, a file-size limit
        shutil.rmtree(stage, ignore_errors=True)
        raise _write_failed(dest, "policy/", e) from None
    if (stage / "draft").is_dir():
        (stage / "draft").rename(stage / "policy" / "draft")
    publish(stage / "policy", dest)
    shutil.rmtree(stage, ignore_errors=True)
    return dest
