"""Tasks with verifiable answers: procedural arithmetic and word problems, and rewards."""

from specroll.tasks.arithmetic import LEVELS, Problem, generate_problems
from specroll.tasks.reward import extract_answer, math_reward
from specroll.tasks.sets import encode, math_problems, prompt_set

__all__ = [
    "LEVELS",
    "Problem",
    "encode",
    "extract_answer",
    "generate_problems",
    "math_problems",
    "math_reward",
    "prompt_set",
]
