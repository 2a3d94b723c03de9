"""Tasks with verifiable answers: procedural arithmetic and word problems, and rewards."""

from specroll.rl.tasks.arithmetic import LEVELS, Problem, generate_problems
from specroll.rl.tasks.reward import extract_answer, math_reward

__all__ = ["LEVELS", "Problem", "extract_answer", "generate_problems", "math_reward"]
