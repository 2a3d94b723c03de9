"""How long the built-in rewards take on adversarial completions (issue 44, item 3).

A policy can write anything, so the answer extractor (`tasks.reward.extract_answer`) and
the built-ins on top of it (`math`, `exact_match`, `format`) must take time linear in the
completion. Each case below is a completion of 1 KB, 64 KB and 1 MB built to hit one way
a regex or a scan can go superlinear:

  blank_lines     lines of 80 spaces (`^\\s*` under re.MULTILINE backtracking across lines)
  trailing_space  'Answer: 1', a run of spaces, 'x' (a lazy group tried before each space)
  open_boxed      '\\boxed{' and then only '{' (a brace scan that never closes)
  answer_lines    'Answer: 1' on every line (one match per line)
  long_answer     'Answer: 1+1+...+1' (what math-verify would be handed)
  deep_boxed      '\\boxed{((((...1...))))}' (deep nesting for math-verify's parser)
  label_lines     'Answer' and spaces on every line, never a colon (labels that fail late)
  star_lines      stars, then spaces, on every line (the optional bold around the label)

Every (case, size) runs in a child process under `--timeout` seconds, timing
`extract_answer` and each built-in once (after one warm-up call on a short text, so
imports are not counted). A case that does not finish is reported as
{"timeout": seconds}. The last line is a JSON object with every figure.

    python benchmarks/extractor_time.py [--timeout 20] [--reward-file OLD/reward.py]

--reward-file times another version of `specroll/tasks/reward.py` (e.g. one saved from
an earlier commit with `git show REV:specroll/tasks/reward.py`), for before/after figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

SIZES = {"1KB": 1 << 10, "64KB": 1 << 16, "1MB": 1 << 20}
CASES = (
    "blank_lines",
    "trailing_space",
    "open_boxed",
    "answer_lines",
    "long_answer",
    "deep_boxed",
    "label_lines",
    "star_lines",
)

CHILD = r"""
import importlib.util, json, sys, time

case, n, source = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if source:
    spec = importlib.util.spec_from_file_location("reward_under_test", source)
    reward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward)
else:
    from specroll.tasks import reward
BUILTINS, extract_answer = reward.BUILTINS, reward.extract_answer
def make(case, n):
    if case == "blank_lines":
        return "\n".join([" " * 80] * max(1, n // 81))
    if case == "trailing_space":
        return "Answer: 1" + " " * (n - 10) + "x"
    if case == "open_boxed":
        return "\\boxed{" + "{" * (n - 7)
    if case == "answer_lines":
        return "Answer: 1\n" * (n // 10)
    if case == "long_answer":
        return "Answer: " + "1+" * ((n - 9) // 2) + "1"
    if case == "deep_boxed":
        d = (n - 10) // 2
        return "\\boxed{" + "(" * d + "1" + ")" * d + "}"
    if case == "label_lines":
        return ("Answer" + " " * 73 + "\n") * (n // 80)
    if case == "star_lines":
        return ("*" * 40 + " " * 39 + "\n") * (n // 80)
    raise SystemExit(case)
text = make(case, n)
record = {"answer": "72"}
for fn in BUILTINS.values():  # warm-up: imports (math-verify) are not what is measured
    fn("p", "Answer: 3", record)
out = {"chars": len(text)}
t0 = time.perf_counter()
extract_answer(text)
out["extract_answer"] = time.perf_counter() - t0
for name, fn in BUILTINS.items():
    t0 = time.perf_counter()
    fn("p", text, record)
    out[name] = time.perf_counter() - t0
print(json.dumps(out))
"""


def run_case(case: str, n: int, timeout: float, source: str = "") -> dict:
    """One (case, size) in a child process: its seconds per function, or the timeout."""
    try:
        p = subprocess.run(
            [sys.executable, "-c", CHILD, case, str(n), source],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"timeout": timeout}
    if p.returncode != 0:
        return {"error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}
    got = json.loads(p.stdout.strip().splitlines()[-1])
    return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in got.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds per (case, size)")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset")
    ap.add_argument("--reward-file", default="", help="time this reward.py instead")
    args = ap.parse_args()
    results: dict[str, dict] = {}
    worst = 0.0
    for case in args.cases.split(","):
        results[case] = {}
        for size, n in SIZES.items():
            r = run_case(case, n, args.timeout, args.reward_file)
            results[case][size] = r
            secs = [v for k, v in r.items() if k not in ("chars",) and isinstance(v, float)]
            worst = max(worst, r.get("timeout", 0.0), *secs)
            print(f"{case:15s} {size:5s} {r}", flush=True)
    source = args.reward_file or "specroll/tasks/reward.py"
    print(
        json.dumps(
            {
                "reward_file": source,
                "timeout_s": args.timeout,
                "worst_s": round(worst, 5),
                "cases": results,
            }
        )
    )


if __name__ == "__main__":
    main()
