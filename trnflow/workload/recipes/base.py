"""What the pipeline needs from a model, and nothing more: a `Recipe`.

The pipeline (sanity, collectives, ahead-of-time compilation, training with exact resume, the
parity gate, batch inference, the registry, cloud dispatch) never looks inside the model. A recipe
says which columns of a row it reads, how those become tensors, which network maps them to logits,
and what its loss is:

- `Params`: a pydantic model of its settings, given in the spec as `model.params`;
- a featurizer (`fit`, `state`, `load`): what is learned from the training rows before training
  (a tokenizer, feature scales), saved beside every checkpoint and model version so that a later
  run or an inference job turns rows into the same numbers;
- `features`: rows to one tensor of a fixed shape per row (padded or cut), so every batch has
  the same shape, the compile cache stays warm and the recompile guard holds;
- `build_model`: the network, whose `forward` maps a batch of features to logits, and whose
  `embed`, if the recipe publishes embeddings, maps it to one vector per row;
- `loss`: the training loss of logits and labels, computed outside the compiled graph;
- `optimizer`: what updates the weights (AdamW by default); training, the ahead-of-time trial
  (whose graphs are the compile cache's keys) and the memory estimate all take it from here;
- `blocks`: the units sharded training gathers one at a time (the transformer layers), and that
  activation checkpointing recomputes (`saved_ops`: what a selective one keeps);
- `tensor_plan`: which of the blocks' layers tensor parallelism splits, column- or row-wise;
- `metrics`: the gate metrics its outputs support, `evaluate` computing them on a holdout set and
  `outcomes` saying which rows were right (for the gate's paired test);
- `publish`: the columns batch inference writes for each row.

A classifier's defaults need none of the last three. A recipe whose rows have no labels (a
language model: `num_classes` None) reads no label column, and its model's output per row is what
its own `loss`, `evaluate` and `publish` read (a language model's: summed token losses and counts).

Shapes are static: every tensor `features` returns has the same shape for each row, and the
pipeline batches rows into fixed-size batches (filling the last with copies of a real row, whose
outputs are thrown away).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pyarrow as pa
from pydantic import BaseModel

from trnflow.errors import FatalError, FieldError
from trnflow.lifecycle.gate import DIRECTIONS
from trnflow.records import RecipeRef
from trnflow.specs import DataSpec, TrainSpec

if TYPE_CHECKING:  # the networks need torch; what a spec check asks of a recipe does not
    import torch
    from torch import nn

    from trnflow.device.layout import TensorPlan
    from trnflow.workload.packing import Packer

METRICS = ("accuracy", "loss", "f1", "auc")
"""What the evaluation computes from logits and labels (the gate's `metric` and `metrics`)."""


SAVED_OPS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_efficient_attention_forward", "_flash_attention_forward", "convolution")
"""What a recipe's block keeps by default under selective activation checkpointing: the operations
whose cost grows with a weight's size or with the square of the sequence."""


class Recipe(ABC):
    """One kind of model. Subclasses set the class attributes and the abstract methods; an instance
    holds validated `params`, the spec's data section and, once `fit` or `load` ran, its featurizer."""

    name: ClassVar[str]
    """How specs name it (`model.recipe`) and `trnflow recipes` lists it."""
    version: ClassVar[str]
    """Part of every compile-cache key, registry version and run record: bump it when the
    recipe's maths changes, so that nothing made by the old one is taken for the new one's."""
    Params: ClassVar[type[BaseModel]]
    """Its settings; a spec's `model.params` is validated against it."""
    featurizer_file: ClassVar[str] = "featurizer.json"
    """The file the featurizer's state is saved as, beside each checkpoint and model version."""
    metrics: ClassVar[tuple[str, ...]] = METRICS
    """The gate metrics its predictions support."""
    directions: ClassVar[dict[str, str]] = {}
    """Which way each of its metrics that trnflow does not know is better: "higher" or "lower"
    (trnflow knows accuracy, f1, auc and token_accuracy are better higher, loss and perplexity lower)."""
    embeds: ClassVar[bool] = True
    """Whether its model has `embed`: the inference stage publishes embeddings, else predictions."""
    generates: ClassVar[bool] = False
    """Whether it generates text (`inference.generate`): its model has `next_logits`, and `prefill`
    and `decode_next` for a cache of keys and values (unless `kv_cache_problem` says why not), and it has
    `prompts` and `decode`."""
    packs: ClassVar[bool] = False
    """Whether its training rows can be packed several to a window (`data.packing`): its features
    are token rows (ids, real, counted) and its model reads a window's positions (`packer`)."""
    saved_ops: ClassVar[tuple[str, ...]] = SAVED_OPS
    """The ATen operations (by name) whose outputs a block keeps under selective activation
    checkpointing (`train.activation_checkpointing: selective`); the rest of a block's work is
    recomputed in the backward pass. Those that are dear to compute again belong here."""
    preloads: ClassVar[tuple[str, ...]] = ()
    """Libraries its model is built with that take seconds to import: a launcher imports them once,
    before it forks a job's ranks, and the local fork server once for every job of trnflow's own
    recipes, instead of every rank of every job importing them again."""

    def __init__(self, params: BaseModel, data: DataSpec):
        self.params, self.data = params, data

    # -- rows to tensors -------------------------------------------------------------------------

    @property
    @abstractmethod
    def num_classes(self) -> int | None:
        """Labels are integers 0..num_classes-1; logits have this many columns. None: the rows have no
        labels (no label column is read, and each row's label is 0)."""

    @property
    def width(self) -> int:
        """Columns of the model's output per row: the logits' for a classifier."""
        if self.num_classes is None:
            raise NotImplementedError(f"recipe {self.name} reads no labels: it says how wide its outputs are")
        return self.num_classes

    @abstractmethod
    def columns(self) -> list[str]:
        """The columns of a row it reads (besides `data.label_field` and `data.id_field`)."""

    @abstractmethod
    def fit(self, rows: pa.Table) -> None:
        """Learn the featurizer from the training rows (the same rows always give the same state)."""

    def fit_batches(self, batches: Iterable[pa.Table]) -> None:
        """`fit` on training rows that arrive a batch at a time (a training set need not fit in memory).
        This default gathers them into one table for `fit`; a featurizer that can learn from a stream
        (as the BPE tokenizer does) overrides it and holds only one batch at a time."""
        tables = list(batches)
        self.fit(pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0])

    @abstractmethod
    def state(self) -> bytes:
        """The featurizer, as saved in `featurizer_file`."""

    @abstractmethod
    def load(self, state: bytes, source: str) -> None:
        """Take a saved featurizer; refuse, naming `source` and the fix, one this recipe cannot use."""

    @abstractmethod
    def features(self, rows: pa.Table) -> torch.Tensor:
        """The model's input for each row: one tensor of shape (rows, ...), the same per-row shape
        whatever the rows."""

    @classmethod
    def packing_problem(cls, params: BaseModel) -> str | None:
        """Why a model of these params cannot train on packed rows (`packs`), or None."""
        return None

    @classmethod
    def kv_cache_problem(cls, params: BaseModel) -> str | None:
        """Why a model of these params cannot generate with a cache of keys and values
        (`inference.generate.kv_cache`, for a recipe that `generates`), or None."""
        return None

    def packer(self) -> Packer:
        """What packs its featurized training rows into windows (`packs`; the featurizer fitted)."""
        raise NotImplementedError(f"recipe {self.name} does not pack rows (data.packing)")

    @abstractmethod
    def example(self, rows: int, generator: torch.Generator) -> torch.Tensor:
        """Made-up input of `rows` rows with the run's shape and dtype (for trial runs: the compile
        stage traces the programs on it before any data is read)."""

    # -- the network -----------------------------------------------------------------------------

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A fresh network (torch's global seed is set before this is called)."""

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The training loss, outside the compiled graph: cross-entropy in fp32."""
        import torch.nn.functional as F  # torch (~1 s): only where a model trains, never for a spec check

        return F.cross_entropy(logits.float(), labels)

    def evaluate(self, outputs: torch.Tensor, labels: torch.Tensor, names: list[str]) -> dict[str, float | None]:
        """Metrics of a whole holdout set from the model's outputs for every row (float64): accuracy
        and each of `names` that it supports. This default: classification metrics of logits."""
        from trnflow.workload.metrics import classification_metrics  # torch (~1 s): evaluation only

        return classification_metrics(outputs, labels, names)

    def outcomes(self, outputs: torch.Tensor, labels: torch.Tensor) -> str | None:
        """Per holdout row, '1' where the model was right and '0' where not (McNemar's paired test
        compares two models' outcomes); None where its outputs are not right or wrong."""
        return "".join("1" if ok else "0" for ok in (outputs.argmax(-1) == labels).tolist())

    def publish(self, outputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The columns batch inference writes for a batch of rows, from the inference program's
        outputs (`embed`'s, or the logits for a recipe without embeddings): each a tensor of one
        value (1-d) or one vector (2-d) per row, float32 or int64."""
        if self.embeds:
            return {"embedding": outputs}
        return {"prediction": outputs.argmax(-1), "probabilities": outputs.double().softmax(-1).float()}

    def optimizer(self, parameters: Iterable[nn.Parameter], train: TrainSpec) -> torch.optim.Optimizer:
        """The optimizer of the model's `parameters`: AdamW with `train.lr` and `train.weight_decay`.
        Training, the ahead-of-time trial and the memory estimate (which counts the state it keeps
        per weight) all build it here, so a recipe that changes it changes all three alike. It is
        built after the model is on its device (and, for sharded training, after sharding)."""
        import torch  # torch (~1 s): only where a model trains, never for a spec check

        return torch.optim.AdamW(parameters, lr=train.lr, weight_decay=train.weight_decay)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The modules sharded training (`train.parallelism.strategy: fsdp`) shards as units: each is
        gathered whole only while it computes, so the largest of them bounds what a core holds
        unsharded at once. Typically the transformer layers. The default, none, shards the whole
        model as one unit (gathered whole for every step: it saves optimizer state and gradients, not
        weights)."""
        return []

    def tensor_plan(self, model: nn.Module, tp: int) -> TensorPlan:
        """How tensor parallelism (`train.parallelism.tp`) splits `model` over `tp` cores: which linear
        layers of which blocks split by their outputs (column-parallel) and which by their inputs
        (row-parallel), a column-parallel layer feeding a row-parallel one so that each pair needs one
        sum across the cores. FieldError (naming train.parallelism.tp) when the model cannot split so:
        the default, for a recipe that declares no plan."""
        raise FieldError("train.parallelism.tp", f"recipe {self.name} does not declare how its layers split over "
                         "cores (Recipe.tensor_plan); use tp: 1, and strategy fsdp for a model too big for one core")

    def token_lengths(self, rows: pa.Table) -> list[int] | None:
        """Each row's tokens, whole (before any cut to `input_length`), for `trnflow data check`'s
        rows cut and packing fill; None when its rows are not tokens, or it cannot say before its
        featurizer is fitted (the default)."""
        return None

    @property
    def input_length(self) -> int | None:
        """The tokens of a row of the model's input (`token_lengths` beyond it are cut to it); None
        for a recipe whose rows are not tokens."""
        return None

    def prompts(self, features: torch.Tensor, room: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A generating recipe's prompts of feature rows: token ids (rows, seq_len + `room`), each row's
        prompt from its start, then padding; and each prompt's length."""
        raise NotImplementedError(f"recipe {self.name} does not generate text")

    def decode(self, tokens: list[list[int]]) -> list[str]:
        """A generating recipe's text of each row's generated token ids."""
        raise NotImplementedError(f"recipe {self.name} does not generate text")

    @property
    def end_token(self) -> int | None:
        """The token that ends a generated text (None: none does)."""
        return None

    def base(self) -> str | None:
        """The content digest of the frozen weights its model is built with, when some of its weights
        do not train (`requires_grad` off: a LoRA adapter's pretrained model): checkpoints then hold
        only the weights that train and record this digest, and a checkpoint is loaded only into a
        model built on the same base. None (the default): every weight trains and is saved."""
        return None

    def activation_bytes(self, batch: int, value_bytes: int, tp: int = 1) -> int:
        """An estimate of the activations one training step keeps for backward on one core (the memory
        check), with the layers split over `tp` cores (`tensor_plan`); 0 when the recipe cannot say.
        (`tp` is passed only when it is over 1, so a recipe that never splits may leave it out.)"""
        return 0

    def recomputed_bytes(self, batch: int, value_bytes: int, setting: str, tp: int = 1) -> int | None:
        """As `activation_bytes`, with the blocks recomputing their activations as `setting` says
        (`train.activation_checkpointing`: selective, full): what a step keeps, the one block
        recomputed at a time included. None when the recipe cannot say: the estimate then counts
        `activation_bytes`, as if nothing were recomputed."""
        return None

    def export(self, model: nn.Module, folder: Path) -> bool:
        """Write the trained model into `folder` in the model's own library's format (for example
        `save_pretrained`), for users outside trnflow; whether the recipe exports at all. A run
        exports once, at its last step, and the registry version records where."""
        return False

    @classmethod
    def direction(cls, metric: str) -> str:
        """Which way `metric` is better: "higher" or "lower"."""
        found = cls.directions.get(metric) or DIRECTIONS.get(metric)
        if found is None:
            raise FatalError(f"recipe {cls.name}: its metric {metric!r} does not say whether higher or lower is "
                             "better; the recipe sets it in its `directions`")
        return found

    @classmethod
    def canonical_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        """`model.params` as every job should read them, rewritten when the spec is validated (a
        relative path made absolute against the directory trnflow runs from); as given by default."""
        return params

    def local_inputs(self) -> dict[str, str]:
        """Local files or folders its params name that must exist before a run starts (a pretrained
        model's folder), by the spec field that names them: `trnflow validate` notes a missing one,
        `trnflow run` refuses to start without it."""
        return {}

    def remote_inputs(self) -> dict[str, str]:
        """s3:// folders its params name that must exist before a run starts, by the spec field that
        names them: `trnflow validate --data-check` checks them."""
        return {}

    @property
    def key(self) -> str:
        """`name@version`: part of every compile-cache key."""
        return f"{self.name}@{self.version}"

    def describe(self) -> RecipeRef:
        """What a run record says of the model."""
        return RecipeRef(recipe=self.name, version=self.version, params=self.params.model_dump(mode="json"))
