"""The judge: SpecScore over solo, team and busy loads, and the lossless gate (docs/JUDGE.md)."""

from specdec.judge.config import JudgeConfig, Limits

__all__ = ["Judge", "JudgeConfig", "Limits", "run_judge"]


def __getattr__(name: str):
    if name in ("Judge", "run_judge"):  # imported on use: `specdec --help` need not load httpx and numpy
        from specdec.judge import run

        return getattr(run, name)
    raise AttributeError(name)
