"""`specroll export`: a run's policy (and draft) as a directory transformers and vLLM load."""

from __future__ import annotations

import argparse

from specroll.cli import common


def cmd_export(args: argparse.Namespace) -> None:
    from specroll.rl.run import export, export_source

    # everything that can be refused is refused before a weight is read
    export.parse_size(args.max_shard_size)
    dest = export.check_out(args.out, args.overwrite)
    src = export_source.resolve(args.run)
    for line in src.skipped:
        common.log(f"warning: {line}")
    what = f"checkpoint {src.path}" if src.kind == "checkpoint" else f"final policy of {src.path}"
    common.log(f"exporting the {what}")
    with common.status(common.console, f"loading {src.path}"):
        policy, draft, tok = export_source.load(src, log=common.log, adapters=args.peft)
    with common.status(common.console, f"writing {dest}"):
        if args.peft:
            export.write_adapter(policy, dest, export_source.base_name(src))
        else:
            export.write(policy, draft, tok.hf, src.rollout, dest, args.dtype, args.max_shard_size)
    common.stdout.print(str(dest), markup=False, highlight=False)


def add_parser(sub) -> None:
    """export"""
    ex = sub.add_parser(
        "export",
        help="write a run's policy and draft as a Hugging Face directory (transformers, vLLM)",
    )
    ex.add_argument(
        "run",
        metavar="RUN_OR_CHECKPOINT",
        help="a run directory (its newest intact checkpoint, else its final policy/) or one "
        "checkpoint directory (RUN/checkpoints/step-NNNNNN)",
    )
    ex.add_argument("--out", required=True, help="the export directory to write")
    ex.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ex.add_argument(
        "--max-shard-size",
        default="2GB",
        help="largest weight file (e.g. 2GB, 500MB); larger policies are sharded with "
        "model.safetensors.index.json",
    )
    ex.add_argument("--overwrite", action="store_true", help="replace an existing export in --out")
    ex.add_argument(
        "--peft",
        action="store_true",
        help="write a LoRA run's adapters as a PEFT adapter directory (adapter_config.json + "
        "adapter_model.safetensors, for peft.PeftModel.from_pretrained on the base model) "
        "instead of the merged model",
    )
    ex.set_defaults(func=cmd_export)
