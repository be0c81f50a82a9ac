"""`tabular-mlp`: an MLP over numeric columns, a trnflow recipe kept in its own package."""

import json

import pyarrow as pa
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from trnflow.errors import FatalError
from trnflow.workload.recipes import Recipe


class TabularParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    features: list[str] = Field(min_length=1, description="The numeric columns the model reads, in order.")
    hidden: list[int] = Field(default_factory=lambda: [32], description="Hidden layer sizes, in order.")
    num_classes: int = Field(2, ge=2, description="Number of output classes.")


class TabularMLP(Recipe):
    """Standardised numeric columns into an MLP; publishes predictions (no embeddings)."""

    name, version, Params = "tabular-mlp", "1", TabularParams
    featurizer_file, embeds = "scaler.json", False

    @property
    def num_classes(self) -> int:
        return self.params.num_classes

    def columns(self) -> list[str]:
        return list(self.params.features)

    def _raw(self, rows: pa.Table) -> torch.Tensor:
        return torch.tensor([rows.column(c).to_pylist() for c in self.columns()], dtype=torch.float64).T

    def fit(self, rows: pa.Table) -> None:
        x = self._raw(rows)
        self.mean, self.std = x.mean(0), x.std(0).clamp_min(1e-6)

    def state(self) -> bytes:
        return json.dumps({"mean": self.mean.tolist(), "std": self.std.tolist()}).encode()

    def load(self, state: bytes, source: str) -> None:
        try:
            saved = json.loads(state)
            mean, std = list(saved["mean"]), list(saved["std"])
        except (ValueError, TypeError, KeyError):
            raise FatalError(f"{source}: not a scaler of the tabular-mlp recipe (JSON with 'mean' and 'std'); the "
                             "file is damaged or another recipe's: use an earlier checkpoint") from None
        if len(mean) != len(self.columns()):
            raise FatalError(f"{source}: the scaler has {len(mean)} columns, the params name "
                             f"{len(self.columns())}; use the features it was fitted on")
        self.mean, self.std = (torch.tensor(v, dtype=torch.float64) for v in (mean, std))

    def features(self, rows: pa.Table) -> torch.Tensor:
        return ((self._raw(rows) - self.mean) / self.std).float()

    def example(self, rows: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randn(rows, len(self.columns()), generator=generator)

    def build_model(self) -> nn.Module:
        layers, width = [], len(self.columns())
        for size in self.params.hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        return nn.Sequential(*layers, nn.Linear(width, self.num_classes))
