"""Files from elsewhere never run code (issue 44): a checkpoint (single-process `state.pt`,
or a sharded learner's DCP `learner/.metadata` and `.distcp` shards) or a draft trainer's
`trainer.pt` whose files carry a pickle payload is refused by every command that reads it
(`specroll export`, `specroll train --resume` with one process or with FSDP ranks,
`specroll draft train --resume`), in one line naming the file; the payload never runs.

The attacker writes meta.json too, so the checksums of a hostile checkpoint match: each
one here is resealed after its files are written. A control shows that each payload does
run when the same file is unpickled the way torch's defaults would.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import shlex
import shutil
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from specroll.cli import main
from tests.conftest import fails_clearly, train_tiny

CK = Path("checkpoints") / "step-000001"
"""The checkpoint of the 1-step run, relative to the run directory."""
FSDP = ("--set", "learner.strategy=fsdp", "--set", "learner.ranks=2")
FIFO_WAIT_S = 20
"""How long the FIFO test lets a command wait on a FIFO before it gives the reader EOF."""


class Payload:
    """Pickles as a call of `os.system` that creates the file `mark`: what a hostile
    file holds (the issue's reproduction ran `touch` this way)."""

    def __init__(self, mark: Path) -> None:
        self.mark = str(mark)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.mark)}",))


def _reseal(ck: Path) -> None:
    """Rewrite the checkpoint's meta.json so its sizes and SHA-256 match the files, as
    the author of a hostile checkpoint would."""
    meta = json.loads((ck / "meta.json").read_text())
    meta["files"] = {
        str(p.relative_to(ck)): {
            "bytes": p.stat().st_size,
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
        }
        for p in sorted(ck.rglob("*"))
        if p.is_file() and p.name != "meta.json"
    }
    (ck / "meta.json").write_text(json.dumps(meta) + "\n")


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 1-step tiny run (its checkpoint at step 1) and, beside it, the same run
    with that checkpoint in a sharded learner's form (state.pt without weights, DCP
    `learner/`), as `learner.strategy: fsdp` writes it."""
    root = tmp_path_factory.mktemp("untrusted")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECROLL_HOME", str(root / "home"))
        assert train_tiny(root / "run", "--steps", "1") == 0
        shutil.copytree(root / "run", root / "sharded")
        _shard(root / "sharded" / CK)
    return root


def _shard(ck: Path) -> None:
    """Rewrite checkpoint `ck` in the sharded learner's form, with the same weights."""
    from specroll.drafting.trainable import new_draft
    from specroll.model import Transformer
    from specroll.model.hub import resolve
    from specroll.model.weights import load_state, read_config
    from specroll.rl.learner.fsdp import dcp
    from specroll.rl.run import checkpoint
    from tests.conftest import learner

    state = torch.load(ck / "state.pt", weights_only=True)
    policy = Transformer(read_config(resolve("tiny")))
    load_state(policy, state["policy"], "test")
    spec = state["draft_config"]
    draft = new_draft(spec["kind"], spec["config"], policy)
    load_state(draft, state["draft"], "test")
    lr = learner(policy, draft=draft)
    lr.opt.load_state_dict(state["policy_opt"])
    lr.draft_opt.load_state_dict(state["draft_opt"])
    weights = ("policy", "draft", "policy_opt", "draft_opt", "rng", "step")
    rest = {k: v for k, v in state.items() if k not in weights}
    run_id = checkpoint.meta(ck)["run_id"]
    with warnings.catch_warnings():  # one process without a group: meant
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        checkpoint.save(
            ck.parent, 1, rest, run_id=run_id, write=lambda d: dcp.save(lr, draft, d / "learner")
        )


# ------------------------------------------------------------------ the hostile files


def _state_pt(ck: Path, mark: Path) -> Path:
    """state.pt carries the payload (among real tensors and settings)."""
    state = torch.load(ck / "state.pt", weights_only=True)
    state["rng"] = Payload(mark)
    torch.save(state, ck / "state.pt")
    return ck / "state.pt"


def _metadata(ck: Path, mark: Path) -> Path:
    """learner/.metadata: DCP's own metadata object with the payload inside it."""
    f = ck / "learner" / ".metadata"
    md = pickle.loads(f.read_bytes())
    md.planner_data = Payload(mark)
    f.write_bytes(pickle.dumps(md))
    return f


def _shard_bytes(ck: Path, mark: Path) -> Path:
    """A non-tensor item of the .distcp shard (an optimizer setting, which DCP reads with
    `torch.load(weights_only=False)`) is the payload."""
    sd = _learner_state(ck)
    sd["policy_opt"]["param_groups"][0]["lr"] = Payload(mark)
    _rewrite_dcp(ck, sd)
    (shard,) = (ck / "learner").glob("*.distcp")
    return shard


def _shard_tensor(ck: Path, mark: Path) -> Path:
    """A tensor item of the .distcp shard points at a pickled payload appended to it."""
    f = ck / "learner" / ".metadata"
    md = pickle.loads(f.read_bytes())
    (shard,) = (ck / "learner").glob("*.distcp")
    blob = io.BytesIO()
    torch.save(Payload(mark), blob)
    offset = shard.stat().st_size
    with open(shard, "ab") as out:
        out.write(blob.getvalue())
    index = next(i for i in md.storage_data if i.fqn.startswith("policy.") and "norm" not in i.fqn)
    info = md.storage_data[index]
    info.offset, info.length = offset, len(blob.getvalue())
    f.write_bytes(pickle.dumps(md))
    return shard


def _learner_state(ck: Path) -> dict:
    """The DCP state of checkpoint `ck`'s learner, read as plain objects (the test's own
    trusted copy, written by the fixture)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ck.parent / "plain.pt"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp_to_torch_save(ck / "learner", out)
    sd = torch.load(out, weights_only=False)  # the test's own file, just written
    out.unlink()
    return sd


def _rewrite_dcp(ck: Path, sd: dict) -> None:
    import torch.distributed.checkpoint as tdcp

    shutil.rmtree(ck / "learner")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        tdcp.save(sd, checkpoint_id=str(ck / "learner"))


HOSTILE = {
    "state.pt": ("run", [_state_pt]),
    "learner/.metadata": ("sharded", [_metadata]),
    "distcp bytes item": ("sharded", [_shard_bytes]),
    "distcp tensor item": ("sharded", [_shard_tensor]),
    # every file at once: the first one read (state.pt) is refused
    "every file": ("sharded", [_shard_bytes, _shard_tensor, _metadata, _state_pt]),
}


def _hostile(finished: Path, tmp_path: Path, kind: str) -> tuple[Path, Path, Path]:
    """(run directory, the file that must be refused, the payload's marker file): a copy
    of the finished run whose checkpoint carries payload `kind`, resealed."""
    source, writers = HOSTILE[kind]
    run = tmp_path / "run"
    shutil.copytree(finished / source, run)
    mark = tmp_path / "payload-ran"
    refused = [w(run / CK, mark) for w in writers][-1]
    _reseal(run / CK)
    return run, refused, mark


def _refused(capsys, argv: list[str], refused: Path, mark: Path) -> None:
    """The command exits 2 with one line naming `refused`, no traceback, no advice to
    unpickle it, and the payload did not run."""
    last = fails_clearly(capsys, argv, str(refused), "read safely")
    assert "weights_only" not in last
    assert not mark.exists(), "the payload ran"


# ------------------------------------------------------------------ the commands


@pytest.fixture()
def home_of(finished, monkeypatch):
    monkeypatch.setenv("SPECROLL_HOME", str(finished / "home"))


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_export_refuses_a_checkpoint_carrying_a_payload(finished, home_of, tmp_path, capsys, kind):
    run, refused, mark = _hostile(finished, tmp_path, kind)
    out = tmp_path / "hf"
    if kind == "distcp bytes item":  # an optimizer setting: export never reads it
        assert main(["export", str(run / CK), "--out", str(out)]) == 0
        assert not mark.exists(), "the payload ran"
        return
    _refused(capsys, ["export", str(run / CK), "--out", str(out)], refused, mark)
    _refused(capsys, ["export", str(run), "--out", str(out)], refused, mark)
    assert not out.exists()


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_resume_refuses_a_checkpoint_carrying_a_payload(finished, home_of, tmp_path, capsys, kind):
    run, refused, mark = _hostile(finished, tmp_path, kind)
    _refused(
        capsys,
        ["train", "--preset", "tiny", "--out", str(run), "--resume", "--steps", "2"],
        refused,
        mark,
    )
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [
        0,
        1,
    ]


@pytest.mark.parametrize(
    "kind",
    [
        "learner/.metadata",
        pytest.param("distcp tensor item", marks=pytest.mark.slow),
        pytest.param("distcp bytes item", marks=pytest.mark.slow),
        pytest.param("state.pt", marks=pytest.mark.slow),  # refused before the ranks start
    ],
)
def test_fsdp_ranks_refuse_a_checkpoint_carrying_a_payload(
    finished, home_of, tmp_path, capsys, kind
):
    """A 1-process checkpoint resumed by 2 FSDP ranks (1 -> 2): each rank reads it."""
    import multiprocessing

    run, refused, mark = _hostile(finished, tmp_path, kind)
    argv = ["train", "--preset", "tiny", "--out", str(run), "--resume", "--steps", "2", *FSDP]
    before = set(multiprocessing.active_children())
    try:
        _refused(capsys, argv, refused, mark)
    finally:  # the ranks this command started, should it leave them running
        for p in set(multiprocessing.active_children()) - before:
            p.kill()
            p.join(timeout=10)


def test_a_sharded_checkpoint_still_resumes_and_exports(finished, home_of, tmp_path, capsys):
    """The control: the same checkpoint without a payload loads through the same paths."""
    run = tmp_path / "run"
    shutil.copytree(finished / "sharded", run)
    assert main(["export", str(run / CK), "--out", str(tmp_path / "hf")]) == 0
    assert train_tiny(run, "--resume", "--steps", "2") == 0
    assert "resumed from" in capsys.readouterr().err


def test_each_payload_runs_when_unpickled_unsafely(finished, tmp_path):
    """The control: the hostile files are hostile (plain pickle / torch.load's unsafe mode
    runs their payload), so the refusals above are what kept it from running."""
    for kind, load in [
        ("state.pt", lambda f: torch.load(f, weights_only=False)),
        ("learner/.metadata", lambda f: pickle.loads(f.read_bytes())),
    ]:
        d = tmp_path / kind.replace("/", "-")
        run, refused, mark = _hostile(finished, d, kind)
        load(refused)
        assert mark.exists(), kind


# ------------------------------------------------------------------ draft training


@pytest.fixture
def data_dir(tmp_path_factory, monkeypatch) -> Path:
    """A tiny `draft data` directory (4 rollouts of 6 tokens) and its SPECROLL_HOME, as
    tests/test_hostile_cli.py builds them (shared when both run)."""
    home = tmp_path_factory.getbasetemp() / "hostile-home"
    monkeypatch.setenv("SPECROLL_HOME", str(home))
    d = tmp_path_factory.getbasetemp() / "hostile-data"
    if not (d / "meta.json").is_file():
        argv = ["draft", "data", "--policy", "tiny", "--n", "4", "--shard-size", "4"]
        assert main([*argv, "--max-new-tokens", "6", "--out", str(d)]) == 0
    return d


def test_draft_train_resume_refuses_a_trainer_state_carrying_a_payload(data_dir, tmp_path, capsys):
    out = tmp_path / "draft"
    argv = ["draft", "train", "--data", str(data_dir), "--out", str(out), "--epochs", "1"]
    fast = ["--ttt-steps", "1", "--draft-vocab-size", "32"]
    assert main([*argv, *fast]) == 0
    state = torch.load(out / "trainer.pt", weights_only=True)  # what it holds: plain data
    mark = tmp_path / "payload-ran"
    torch.save({**state, "config": Payload(mark)}, out / "trainer.pt")
    _refused(capsys, [*argv, *fast, "--resume"], out / "trainer.pt", mark)


def test_fsdp_ranks_read_a_state_pt_as_data_only(finished, home_of, tmp_path):
    """The ranks' own read of a single-process state.pt (`learner.strategy: fsdp`
    restoring a 1-process checkpoint) refuses a payload in one line, in every rank."""
    from specroll.model.untrusted import UnreadableFile
    from specroll.rl.config import build_config
    from specroll.rl.learner.fsdp.host import FSDPLearnerHost
    from specroll.rl.run.draft import build_draft

    run, refused, mark = _hostile(finished, tmp_path, "state.pt")
    cfg = build_config("tiny", ["learner.strategy=fsdp", "learner.ranks=2"])
    policy, tok = _tiny()
    host = FSDPLearnerHost(cfg, policy, build_draft(cfg, policy, tok, tmp_path))
    try:
        with pytest.raises(UnreadableFile, match="read safely") as e:
            host.restore({"path": str(run / CK), "policy": None})
    finally:
        host.close()
    assert str(e.value).startswith(f"{refused}: ") and "\n" not in str(e.value)
    assert not mark.exists(), "the payload ran"


def test_a_fifo_in_place_of_a_checkpoint_file_is_refused_not_waited_on(
    finished, home_of, tmp_path, capsys
):
    """learner/.metadata as a FIFO (left out of meta.json): export refuses it at once,
    where opening it would wait for a writer forever."""
    run = tmp_path / "run"
    shutil.copytree(finished / "sharded", run)
    fifo = run / CK / "learner" / ".metadata"
    fifo.unlink()
    os.mkfifo(fifo)
    _reseal(run / CK)
    done = threading.Event()

    def unblock() -> None:  # a reader waiting on the FIFO: give it an end of file
        if not done.wait(FIFO_WAIT_S):
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    threading.Thread(target=unblock, daemon=True).start()
    start = time.monotonic()
    try:
        rc = main(["export", str(run / CK), "--out", str(tmp_path / "hf")])
    finally:
        done.set()
    assert time.monotonic() - start < FIFO_WAIT_S, "export waited on the FIFO"
    assert rc == 2 and f"{fifo}: not a regular file" in capsys.readouterr().err


def _tiny():
    from specroll.model import load_model
    from specroll.model.hub import resolve
    from specroll.model.tokenizer import Tokenizer

    d = resolve("tiny")
    return load_model(d), Tokenizer(d)


# ------------------------------------------------------------------ a model directory's code


def test_a_model_directory_with_its_own_code_is_never_offered_to_run(
    finished, home_of, tmp_path, monkeypatch
):
    """A policy directory whose tokenizer_config.json / config.json name a module of
    their own (`auto_map`): the tokenizer is refused and the HF baseline model loads the
    built-in class, without transformers asking "run the custom code? [y/N]" (a `y`, or
    a piped stdin, would have run it)."""
    from specroll.engine.bench import _hf_model
    from specroll.model.hub import resolve
    from specroll.model.tokenizer import Tokenizer

    d = tmp_path / "model"
    shutil.copytree(resolve("tiny"), d)
    mark = tmp_path / "module-ran"
    (d / "own_code.py").write_text(f"open({str(mark)!r}, 'w').close()\nclass Own: pass\n")
    for name, key in (("tokenizer_config.json", "AutoTokenizer"), ("config.json", "AutoConfig")):
        cfg = json.loads((d / name).read_text())
        target = [None, "own_code.Own"] if key == "AutoTokenizer" else "own_code.Own"
        cfg["auto_map"] = {key: target, "AutoModelForCausalLM": "own_code.Own"}
        if key == "AutoTokenizer":
            cfg["tokenizer_class"] = "Own"  # only its own code could build it
        (d / name).write_text(json.dumps(cfg))
    asked: list[str] = []
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "y")
    with pytest.raises(ValueError, match="no usable tokenizer"):
        Tokenizer(d)
    _hf_model(str(d), torch.device("cpu"), torch.float32)
    assert asked == [] and not mark.exists(), "offered to run the directory's code"


# ------------------------------------------------------------------ a full disk on export

FSIZE_LIMIT = 64 * 1024
"""`ulimit -f` of the export below, in bytes: less than the tiny policy's weights."""


def test_an_export_past_the_file_size_limit_fails_in_one_line(finished, home_of, tmp_path):
    """`ulimit -f` (EFBIG) during `specroll export`: one `error:` line naming the file
    and why, exit status 1, and nothing left in or beside --out."""
    import subprocess
    import sys

    out = tmp_path / "hf"
    code = (
        "import resource, sys; "
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({FSIZE_LIMIT}, {FSIZE_LIMIT})); "
        "from specroll.cli import main; "
        f"sys.exit(main(['export', {str(finished / 'run')!r}, '--out', {str(out)!r}]))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr and "SafetensorError" not in p.stderr
    assert last.startswith("error: could not write the export"), p.stderr
    assert "model.safetensors" in last and "File too large" in last
    assert sorted(tmp_path.iterdir()) == []  # no export, no staging directory


# ------------------------------------------------------------------ sizes a file implies


def test_a_checkpoint_whose_draft_config_implies_a_huge_draft_is_refused_unallocated(
    finished, home_of, tmp_path, capsys, monkeypatch
):
    run = tmp_path / "run"
    shutil.copytree(finished / "run", run)
    ck = run / CK
    state = torch.load(ck / "state.pt", weights_only=True)
    layer = {**state["draft_config"]["config"], "intermediate_size": 1 << 40}
    state["draft_config"] = {"kind": "eagle3", "config": layer}
    torch.save(state, ck / "state.pt")
    _reseal(ck)
    empty = torch.empty

    def no_huge(*size, **kw):  # what allocating the draft would have asked for
        n = 1
        for s in size[0] if size and isinstance(size[0], tuple | list) else size:
            n *= int(s)
        assert n < 1 << 32, f"allocated {n} elements"
        return empty(*size, **kw)

    monkeypatch.setattr(torch, "empty", no_huge)
    fails_clearly(capsys, ["export", str(ck), "--out", str(tmp_path / "x")], "state.pt", "draft")


def test_a_model_whose_config_implies_more_than_its_weights_is_refused(home_of, tmp_path):
    from specroll.model.hub import resolve
    from specroll.model.weights import load_model

    d = tmp_path / "model"
    shutil.copytree(resolve("tiny"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 1 << 17  # within the size limits, beyond the weights
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json describes .* parameters; the weight"):
        load_model(d)
