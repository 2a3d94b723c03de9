"""Settings, data and measurements from elsewhere (issue 58): large data files read once
with progress, cost profiles checked field by field (a damaged cache measured again),
benchmark scripts that fail in one line, and the small ones: a second Ctrl-C mid
checkpoint, YAML's nesting and size bounds, keys and numbers that cannot be printed raw."""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

import pytest

from specroll.engine.costmodel import COST_FIELDS, CostModel
from specroll.rl.config import yaml_safe
from specroll.rl.config.io import set_value
from specroll.rl.run import checkpoint
from tests.conftest import fails_clearly, train_tiny
from tests.test_depth import measured  # noqa: F401 (a fixture)

# ---------------------------------------------------------------- a large data file


def test_a_large_data_file_is_read_once_with_progress(home, tmp_path, capsys, monkeypatch):
    from specroll.tasks import sets

    lines = 60_000  # past files.PROGRESS_LINES: the reading reports its progress
    data = tmp_path / "big.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(lines)))  # fmt: skip
    reads = []
    real = sets.json_lines  # the pass that reads and checks every line
    monkeypatch.setattr(sets, "json_lines", lambda *a: reads.append(str(a[0])) or real(*a))
    start = time.monotonic()
    assert train_tiny(tmp_path / "run", "--steps", "1", "--set", f"data.train={data}") == 0
    assert time.monotonic() - start < 120
    assert reads == [str(data)]  # planning, the draft's start and the task share one read
    err = capsys.readouterr().err
    assert "reading data.train (lines): started (total 60001)" in err
    assert "reading data.train (lines): done" in err


def test_a_jsonl_files_problems_are_kept_as_its_bytes_and_built_as_read(tmp_path):
    import tracemalloc

    from specroll.tasks.sets import load_file

    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1), "i": i} for i in range(60_000)]
    lines = tmp_path / "d.jsonl"
    lines.write_text("".join(json.dumps(r) + "\n" for r in rows))
    array = tmp_path / "d.json"
    array.write_text(json.dumps(rows))
    tracemalloc.start()
    try:
        kept = load_file(lines)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 3 * lines.stat().st_size  # the bytes and a few numbers a record
    whole = load_file(array)  # the same records, each built at once
    assert len(kept) == len(whole) == 60_000
    for i in (0, 1, 59_999, -1):
        a, b = kept[i], whole[i]
        assert (a.prompt, a.answer, a.record) == (b.prompt, b.answer, b.record)
    assert kept[7].uid == "d.jsonl:8" and kept[10:20][3].uid == "d.jsonl:14"


# ------------------------------------------------------------------- cost profiles


def _profile(tmp_path: Path, **fields) -> Path:
    p = tmp_path / "profile.json"
    p.write_text(json.dumps({"fixed": 1e-3, "per_token": 1e-4, "knee": 8.0, **fields}))
    return p


@pytest.mark.parametrize(
    "fields,needle",
    [
        (dict.fromkeys(COST_FIELDS, -1.0), "fixed=-1.0 must be a finite number in 0..10000"),
        ({"per_token": float("nan")}, "per_token=nan"),
        ({"kv": 1e300}, "kv=1e+300"),
        ({"knee": 0.5}, "knee=0.5 must be a finite number in 1.."),
        ({"fixed": 0.0, "per_token": 0.0}, "costs nothing"),
        ({"meta": []}, "meta must be a JSON object"),
        ({"fixed": "1ms"}, "fixed='1ms'"),
    ],
)
def test_a_profile_from_elsewhere_is_checked_field_by_field(tmp_path, fields, needle):
    p = _profile(tmp_path, **fields)
    with pytest.raises(ValueError, match="rollout.profile") as e:
        CostModel.load(p, "rollout.profile")
    assert str(p) in str(e.value) and needle in str(e.value)


def test_a_truncated_profile_names_the_file_and_the_setting(home, tmp_path, capsys):
    p = _profile(tmp_path)
    p.write_text(p.read_text()[:20])
    run = ["train", "--preset", "tiny", "--out", str(tmp_path / "run"), "--steps", "1"]
    fails_clearly(
        capsys,
        [*run, "--set", "rollout.depth=adaptive", "--set", f"rollout.profile={p}"],
        str(p),
        "rollout.profile is not valid JSON",
    )


def test_a_damaged_cached_profile_is_measured_again_never_used(tiny_model, tmp_path, measured):  # noqa: F811
    from specroll.drafters.ngram import NgramDrafter

    P, calls = measured
    d, heard = NgramDrafter(), []
    P.cached_profile(tiny_model, d, [[1, 2, 3]], P.MEASURE, log=heard.append)
    (path,) = (tmp_path / "profiles").iterdir()
    for damage in ('{"fixed": -5, "per_token": -1}', '{"fixed": 0.1, "per', "[1, 2]"):
        path.write_text(damage)
        cm = P.cached_profile(tiny_model, d, [[1, 2, 3]], P.MEASURE, log=heard.append)
        assert cm.fixed > 0 and CostModel.load(path).fixed == cm.fixed  # measured, cached
        assert f"{path}: " in heard[-2] and heard[-2].endswith("not used, removed")
    assert len(calls) == 4
    path.write_text("{}")  # without MEASURE: a quick profile, the damaged file gone
    cm = P.cached_profile(tiny_model, d, [[1, 2, 3]], log=heard.append)
    assert cm.fixed > 0 and not path.exists()
    # the quick profile says it is measuring before it measures (minutes on a busy machine)
    assert heard[-2].startswith("a quick hardware profile for adaptive depth: measuring")


# ------------------------------------------------------------------ benchmark scripts


def _bench(capsys, monkeypatch, script: str, *args: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `benchmarks/SCRIPT ARGS`, run in this process."""
    import importlib

    module = importlib.import_module(f"benchmarks.{script}")
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *args])
    capsys.readouterr()
    try:
        module.main(list(args)) if script == "gpu_check" else module.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(got: tuple[int, str, str], *needles: str) -> None:
    code, _, err = got
    assert code == 2 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err


def test_benchmarks_read_a_finished_run_and_refuse_mistakes_in_one_line(
    home, tmp_path, capsys, monkeypatch
):
    run = tmp_path / "run"
    assert train_tiny(run, "--steps", "2") == 0
    code, out, err = _bench(capsys, monkeypatch, "start_options", f"a={run}", f"b={run}@12")
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["mean_reward"].keys() == {"a", "b"}
    bench = functools.partial(_bench, capsys, monkeypatch)
    _one_line(bench("start_options", f"a={run}@soon"), "SECONDS a number")
    _one_line(bench("start_options", str(run)), "expected NAME=RUN_DIR[@SECONDS]")
    _one_line(bench("lora_runs", f"a={tmp_path}"), "not a run directory")
    missing = str(tmp_path / "nowhere" / "x.png")
    _one_line(bench("start_options", f"a={run}", "--plot", missing), "does not exist")
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (damaged / "metrics.jsonl").write_text(lines[0] + "\n" + lines[1][:30] + "\n")
    for script in ("start_options", "lora_runs"):
        _one_line(bench(script, f"a={damaged}"), f"{damaged / 'metrics.jsonl'}:2: not a JSON")
    start = time.monotonic()
    _one_line(bench("gpu_check", "--device", "cpu", "--out", missing), "does not exist")
    assert time.monotonic() - start < 2  # refused before any work


# --------------------------------------------------------------------- small ones


def test_a_second_ctrl_c_mid_checkpoint_leaves_no_partial_directory(tmp_path):
    def interrupted(directory: Path) -> None:
        (directory / "learner.bin").write_bytes(b"x" * 1024)
        raise KeyboardInterrupt  # the second Ctrl-C, while the state is written

    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, 3, {"config": {}}, write=interrupted)
    assert list(tmp_path.iterdir()) == []


def test_yaml_nesting_counts_containers_and_the_error_points_at_the_deepest():
    assert yaml_safe.load("[" * 64 + "1" + "]" * 64) is not None
    for depth in (65, 80):
        with pytest.raises(Exception, match="nested more than 64 deep") as e:
            yaml_safe.load("[" * depth + "1" + "]" * depth)
        assert f"column {65}" in str(e.value)  # where the 65th opens, whatever the depth
    block = "".join("  " * i + "a:\n" for i in range(65)) + "  " * 65 + "1\n"
    with pytest.raises(Exception, match="line 65"):
        yaml_safe.load(block)


def test_a_huge_flow_sequence_is_refused_in_a_moment():
    text = "a: [" + ",".join(["1"] * 250_000) + "]"  # about 1 MiB
    start = time.monotonic()
    with pytest.raises(yaml_safe.YAMLTooLarge, match="more than 10000 values"):
        yaml_safe.load(text)
    assert time.monotonic() - start < 3


def test_keys_and_numbers_from_a_config_are_never_printed_raw(tmp_path, capsys):
    bad = tmp_path / "nul.yaml"
    bad.write_text('policy:\n  "lr\\0\\x1b[31m": 1\n')
    last = fails_clearly(capsys, ["train", "--preset", "tiny", "--config", str(bad)], "lr\\x00")
    assert "\x00" not in last and "\x1b" not in last
    last = fails_clearly(
        capsys, ["train", "--preset", "tiny", "--set", f"lora.rank={10**400}"], "lora.rank"
    )
    assert "(401 digits)" in last and len(last) < 200
    assert set_value("policy.lr", "1" + "0" * 400) == 10**400  # read; refused by its field
    last = fails_clearly(capsys, ["train", "--preset", "tiny", "--set", f"policy.lr={10**400}"])
    assert "policy.lr must be a finite number" in last and len(last) < 200
