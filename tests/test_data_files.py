"""Training on your own data (issue 31): records from JSONL, Parquet or a
`datasets.save_to_disk` directory, the prompt and answer fields named by the user, chat
prompts kept whole with a system prompt and template arguments, a separate validation
file, and no silent fallback to a Hub download."""

from __future__ import annotations

import json
import sys

import pytest

from specroll.rl.config import build_config
from specroll.tasks.sets import Keys, encode, load_file

PLAIN = {"question": "Ana has 3 apples and buys 4. How many?", "solution": {"final": "7"}}
RECORDS = [  # one column type per field, as Arrow requires
    {
        "question": [{"role": "user", "content": PLAIN["question"]}],
        "solution": {"final": "7"},
        "data_source": "a",
    },
    {
        "question": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"},
        ],
        "solution": {"final": "6"},
        "data_source": "b",
    },
]
KEYS = Keys("question", "solution.final")


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _arrow_dir(path, records) -> str:
    """What `Dataset.save_to_disk` writes: Arrow stream files listed in state.json."""
    import pyarrow as pa

    path.mkdir()
    table = pa.Table.from_pylist(records)
    with pa.ipc.new_stream(str(path / "data-00000-of-00001.arrow"), table.schema) as w:
        w.write_table(table)
    state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_split": "train"}
    (path / "state.json").write_text(json.dumps(state))
    (path / "dataset_info.json").write_text("{}")
    return str(path)


def _parquet(path, records) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), str(path))
    return str(path)


@pytest.mark.parametrize("form", ["jsonl", "parquet", "arrow"])
def test_records_from_every_form_keep_their_fields(tmp_path, form):
    pytest.importorskip("pyarrow")
    write = {"jsonl": _jsonl, "parquet": _parquet, "arrow": _arrow_dir}[form]
    name = {"jsonl": "d.jsonl", "parquet": "d.parquet", "arrow": "d"}[form]
    items = load_file(write(tmp_path / name, RECORDS), KEYS)
    assert [(p.prompt, p.answer) for p in items] == [
        (PLAIN["question"], "7"),
        ("And 3+3?", "6"),
    ]
    assert [p.record["data_source"] for p in items] == ["a", "b"]
    assert [m["role"] for m in items[0].messages] == ["user"]
    assert [m["role"] for m in items[1].messages] == ["system", "user", "assistant", "user"]


def test_missing_fields_and_pyarrow_are_named(tmp_path, monkeypatch):
    f = _jsonl(tmp_path / "d.jsonl", RECORDS)
    with pytest.raises(
        ValueError,
        match=r"d.jsonl:1: expected a JSON object with a 'prompt' "
        r"field; it has 'question', 'solution', 'data_source'",
    ):
        load_file(f)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if not installed
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    with pytest.raises(ValueError, match=r"needs pyarrow: pip install 'specroll\[parquet\]'"):
        load_file(tmp_path / "x.parquet")


def test_a_datasetdict_or_foreign_directory_is_refused_naming_what_to_do(tmp_path):
    d = tmp_path / "gsm8k"
    d.mkdir()
    (d / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(ValueError, match="DatasetDict with splits train, test.*gsm8k/train"):
        load_file(d)
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="not one saved by datasets' save_to_disk"):
        load_file(tmp_path / "plain")


def test_a_hub_name_is_told_there_is_no_hub_access():
    with pytest.raises(ValueError) as e:
        build_config("tiny", ["data.train=openai/gsm8k"])
    assert "data.train='openai/gsm8k' is not a local file or directory" in str(e.value)
    assert "no hub access" in str(e.value) and "save_to_disk" in str(e.value)
    with pytest.raises(ValueError, match="data.val: no such file or directory 'v.jsonl'"):
        build_config("tiny", ["data.val=v.jsonl"])


def test_train_val_and_task_settings(tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", RECORDS)
    with pytest.raises(ValueError, match=r"data.task is retired: set data.train"):
        build_config("tiny", [f"data.task={f}"])
    for bad, needle in [
        ("data.chat_template_kwargs={add_generation_prompt: false}", "may not set"),
        ("data.chat_template_kwargs=[1]", "must be a mapping"),
        ("data.prompt_key=''", "data.prompt_key must not be empty"),
    ]:
        with pytest.raises(ValueError, match=needle):
            build_config("tiny", [bad])


def test_a_validation_file_and_the_whole_training_file(tmp_path):
    from specroll.rl.run.task import task_files

    train = _jsonl(tmp_path / "t.jsonl", [{"prompt": f"q{i}", "answer": i} for i in range(5)])
    val = _jsonl(tmp_path / "v.jsonl", [{"prompt": f"v{i}", "answer": i} for i in range(9)])
    cfg = build_config("tiny", [f"data.train={train}", f"data.val={val}"])  # val_size 8
    files = task_files(cfg)
    assert [p.prompt for p in files.train] == [f"q{i}" for i in range(5)]  # none held out
    assert [p.prompt for p in files.val] == [f"v{i}" for i in range(8)]
    with pytest.raises(ValueError, match="holds 5 problems, not more than data.val_size=8"):
        task_files(build_config("tiny", [f"data.train={train}"]))
    # answers are needed only by rewards that compare with them
    plain = _jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(9)])
    with pytest.raises(ValueError, match="records without an answer"):
        task_files(build_config("tiny", [f"data.train={plain}"]))
    assert (
        len(
            task_files(
                build_config("tiny", [f"data.train={plain}", "reward.functions=[format]"])
            ).train
        )
        == 9
    )


def test_chat_prompts_are_kept_whole_with_the_system_prompt_and_template_kwargs(tiny_setup):
    _, tok = tiny_setup
    from specroll.tasks.sets import _record

    plain, convo = _record(PLAIN, "r:1", KEYS), _record(RECORDS[1], "r:2", KEYS)
    text = tok.decode(encode(tok, convo, "Think step by step."), skip_special_tokens=False)
    # the record's own system turn wins; every earlier turn reaches the template
    assert "Be brief." in text and "Think step by step." not in text
    assert text.index("What is 2+2?") < text.index("assistant\n4") < text.index("And 3+3?")
    text = tok.decode(encode(tok, plain, "Think step by step."), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nThink step by step.<|im_end|>")
    assert encode(tok, plain) == tok.encode_prompt(plain.prompt)  # nothing set: as before
    seen = {}
    real = tok.hf.apply_chat_template

    def spy(messages, **kw):
        seen.update(kw)
        return real(messages, **{k: v for k, v in kw.items() if k != "enable_thinking"})

    tok.hf.apply_chat_template = spy
    encode(tok, plain, "", {"enable_thinking": False})
    assert seen["enable_thinking"] is False


def test_the_budget_counts_the_system_prompt_and_every_turn(tmp_path):
    from specroll.rl import limits
    from specroll.rl.run.task import task_items

    recs = [
        {
            "prompt": [
                {"role": "user", "content": "x" * 100},
                {"role": "assistant", "content": "y" * 100},
                {"role": "user", "content": "z"},
            ],
            "answer": 1,
        }
    ] * 10
    f = _jsonl(tmp_path / "c.jsonl", recs)
    cfg = build_config("tiny", [f"data.train={f}", "data.system_prompt=" + "s" * 50])
    expected = 201 + 50 + 3 * limits.MESSAGE_OVERHEAD_TOKENS + limits.PROMPT_OVERHEAD_TOKENS
    assert limits.prompt_tokens(cfg, task_items(cfg)) == expected


def test_a_response_prefix_starts_every_reply_and_the_reward_reads_it(tmp_path, tiny_setup):
    """data.response_prefix: 'Answer:' is written after the assistant header (a request's
    prompt ends with it) and read with the completion, so ' 46' scores under `math`."""
    from types import SimpleNamespace

    from specroll.rl.run.task import Task

    _, tok = tiny_setup
    rows = [{"question": f"q{i}", "answer": f"work\n#### {40 + i}"} for i in range(10)]
    train = _jsonl(tmp_path / "t.jsonl", rows)
    sets = [f"data.train={train}", "data.prompt_key=question", "data.val_size=2"]
    plain = Task(build_config("tiny", sets), tok)
    task = Task(build_config("tiny", [*sets, "data.response_prefix='Answer:'"]), tok)
    try:
        (p,) = task.problems(0)[:1]
        prefix = tok.hf.encode("Answer:", add_special_tokens=False)
        ids = task.requests([p], 1, 0)[0].prompt_ids
        assert ids[-len(prefix) :] == prefix and ids[: -len(prefix)] == plain.encode(
            plain.problems(0)[0]
        )
        number = p.answer.rpartition("#### ")[2]
        said = SimpleNamespace(token_ids=tok.hf.encode(f" {number}", add_special_tokens=False))
        assert task.score([p], [said], 1).total.item() == 1.0  # "Answer: 46" read
        assert (
            plain.score(plain.problems(0)[:1], [said], 1).total.item() == 0.0
        )  # " 46" alone commits to none
    finally:
        task.close()
        plain.close()
