"""The judge model at the path the README gives; it lives in `dbs_fast.evaluation.judge`."""
from .evaluation.judge import Judge, judge_for

__all__ = ["Judge", "judge_for"]
