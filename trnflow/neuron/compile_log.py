"""neuron_parallel_compile's progress line, as a type: the compile phase prints it as the tool does
(`INFO ||NEURON_CACHE||: Current remaining items are 3, locked are 0, failed are 0, done are 2,
total is 5`), and `trnflow compile` reads it back into its progress bar. One definition for both."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field

_LINE = re.compile(r"INFO \|\|NEURON_CACHE\|\|: Current remaining items are (?P<remaining>\d+), locked are "
                   r"(?P<locked>\d+), failed are (?P<failed>\d+), done are (?P<done>\d+), total is (?P<total>\d+)")


class CompileProgress(BaseModel):
    """How far an ahead-of-time compile has got, over every graph of the plan."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    remaining: int = Field(ge=0, description="graphs not yet taken by a worker")
    locked: int = Field(ge=0, description="graphs another process holds the lock of")
    failed: int = Field(ge=0)
    done: int = Field(ge=0, description="graphs compiled, or found in the cache")
    total: int = Field(ge=0, description="graphs in the plan")

    @classmethod
    def counting(cls, done: int, failed: int, locked: int, total: int) -> CompileProgress:
        return cls(remaining=total - done - failed - locked, locked=locked, failed=failed, done=done, total=total)

    def line(self) -> str:
        """The progress line as neuron_parallel_compile prints it."""
        return (f"INFO ||NEURON_CACHE||: Current remaining items are {self.remaining}, locked are {self.locked}, "
                f"failed are {self.failed}, done are {self.done}, total is {self.total}")

    @classmethod
    def each_in(cls, text: str) -> list[CompileProgress]:
        """Every progress line in a stretch of log, in order."""
        return [cls(**{k: int(v) for k, v in m.groupdict().items()}) for m in _LINE.finditer(text)]
