"""The programs a job runs on a core, each one whole graph with static shapes: what ahead-of-time
compilation extracts and compiles, and what training, evaluation and inference then call.

- `train_step`: the model's forward pass in train mode, under the spec's autocast, and its backward
  (the recipe's loss is computed outside the graph);
- `eval_step`: logits for one evaluation batch (`sharded_eval_step`: of a sharded model, inside
  sharded training);
- `embed_step`: embeddings for one inference batch;
- with `inference.generate`: `prefill_step`, the prompts' next tokens' logits and the cache of their
  keys and values, and `decode_step`, one token per row through that cache; or, without the cache
  (`kv_cache: false`), `generate_step`, the next token's logits of each row of a fixed-size buffer
  of prompts and the tokens generated so far, at each row's own length.

Evaluation and inference pad their last batch (see `sampler.static_batches`), and training drops
the last partial batch unless told otherwise, so these three shapes are all a run ever sees.
Compilation and the real run call the same methods, so the graphs a trial run extracts are the
graphs the run needs.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trnflow.device.base import CompileBackend, Device, FaultHooks, NoFaults
from trnflow.device.private_torch import flatten, unflatten, whole_graphs_under_ddp
from trnflow.errors import FatalError, TrnflowError
from trnflow.specs import JobSpec
from trnflow.workload.checkpoint import trainable
from trnflow.workload.context import WorkerContext
from trnflow.workload.generate import Caching, Decoding, Recomputing, rehearse
from trnflow.workload.packing import one_per_window
from trnflow.workload.recipes import Recipe
from trnflow.workload.recompute import recompute

PROGRAMS = ("train_step", "eval_step", "embed_step")
SHARDED = ("train_step", "sharded_eval_step")
"""The programs a sharded or split model runs (`train.parallelism.strategy: fsdp`, `tp` > 1):
training and the evaluations inside it. The evaluate and infer stages load the checkpoint whole."""
GENERATING = ("prefill_step", "decode_step", "generate_step")
"""The programs of a generation (`inference.generate`): with the cache of keys and values, the
first two; without it, the last."""
TRIAL_STEPS = 2
"""Training steps in a trial run (forward, backward and optimizer step each)."""


@contextlib.contextmanager
def _compiler_errors() -> Iterator[None]:
    """Dynamo wraps what a backend raises; our own errors (a recompilation refused) come out as themselves."""
    from torch._dynamo.exc import BackendCompilerFailed  # TorchDynamo costs ~1.6 s: only compiling phases load it

    try:
        yield
    except BackendCompilerFailed as exc:
        inner = getattr(exc, "inner_exception", None)
        if isinstance(inner, TrnflowError):
            raise inner from None
        raise


class Programs:
    """One model's three programs, compiled through `compiler` (whole graphs, static shapes) on `device`."""

    def __init__(self, spec: JobSpec, recipe: Recipe, model: nn.Module, compiler: CompileBackend, device: Device,
                 ddp: bool = False, sharded: bool = False, mesh: Any = None, fsdp: bool = False,
                 faults: FaultHooks | None = None):
        """`sharded`: the model was split or sharded (`spread`): it trains and evaluates as its ranks'
        parts, and embeds nothing (inference loads the checkpoint whole); `fsdp`: sharded by FSDP2, it
        runs in parts around its blocks. `ddp`: the replicas average their gradients (DDP; over the
        mesh's `dp` dimension when the layers are split). `faults`: the core's injected faults."""
        # A fresh Dynamo state: compiled code is cached per function, and a process builds its
        # programs once (tests build several; stale entries would count against the recompile limit).
        torch._dynamo.reset()
        model.to(device.torch_device)  # a no-op for a model already there (a trainer's, with its optimizer)
        # One mode for the whole model, as `_mode` reads it off the root: a pretrained model comes
        # out of `from_pretrained` in eval mode inside a wrapper in train mode, and flipping its
        # modules only at the first switch re-traces the train graph after the first evaluation.
        model.train(model.training)
        self.spec, self.recipe, self.model, self.compiler, self.device = spec, recipe, model, compiler, device
        self.sharded, self.fsdp = sharded, fsdp
        self.faults = faults if faults is not None else NoFaults()
        self.own_seconds = 0.0
        """The last training step's own work: forward and backward, before the replicas average their
        gradients (under fsdp and tp, whose passes gather and reduce, their waits for peers too)."""
        self._forward = device.compile(model, compiler, whole=not fsdp)
        self._embed = device.compile(model.embed, compiler) if recipe.embeds and not sharded else None
        generate = spec.inference.generate if recipe.generates and not sharded else None
        caches = generate is not None and generate.kv_cache
        if caches and (refused := getattr(model, "cache_refused", None)):  # a pretrained folder read only now
            raise FatalError(f"inference.generate.kv_cache: {refused}; set inference.generate.kv_cache: false")
        self._next = device.compile(model.next_logits, compiler) if generate and not caches else None
        self._prefill = device.compile(model.prefill, compiler) if caches else None
        self._decode = device.compile(model.decode_next, compiler) if caches else None
        # DDP wraps the compiled module, so the graph is the model's alone, whatever the world size. A
        # split model's replicas average their gradients themselves, over the mesh's dp dimension.
        split = mesh is not None and mesh.ndim == 2
        if ddp and not split:
            whole_graphs_under_ddp()  # the graphs the compile stage's trial met, unwrapped
        self._train_forward = DDP(self._forward) if ddp and not split else self._forward
        self._replicas = mesh["dp"].get_group() if ddp and split else None

    def _mode(self, training: bool) -> None:
        """Train or eval mode, set only when it changes: setting it walks every submodule, which
        costs about 2% of a small model's step."""
        if self.model.training != training:
            self.model.train(training)

    # Inputs go to the device here; the loss stays there for backward, logits and embeddings come
    # back to the host, where they are compared and written.
    def train_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        self._mode(training=True)
        tokens = self.device.put(tokens)
        with self.compiler.naming("train_step", tokens), _compiler_errors(), \
                self.device.autocast(self.spec.compute.precision):
            return self._train_forward(tokens)

    def train_loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.recipe.loss(self.train_logits(tokens), self.device.put(labels))

    def train_step(self, tokens: torch.Tensor, labels: torch.Tensor, optimizer: torch.optim.Optimizer,
                   checked: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss,
                   worked: Callable[[], None] = lambda: None) -> torch.Tensor:
        """One training step, the same on every device and in every trial run: forward and loss,
        backward, sync, optimizer step, sync; then `checked` reads the loss (and may refuse it,
        which stops the run before anything is saved); `worked()` once this rank's own work is done,
        before the replicas average their gradients. A lazy device compiles the step's graphs at
        its two syncs and runs them while the next is traced; the loss is read only once both are
        done, so reading it neither adds a graph nor waits in the middle of the step."""
        began = time.perf_counter()
        loss = self.train_loss(tokens, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.faults.slow_down(time.perf_counter() - began)
        self.own_seconds = time.perf_counter() - began
        worked()
        if self._replicas is not None:
            average_gradients(self.model, self._replicas)
        self.device.sync()
        optimizer.step()
        self.device.sync()
        return checked(loss)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        self._mode(training=False)
        tokens = self.device.put(tokens)
        program = "sharded_eval_step" if self.sharded else "eval_step"
        # FSDP2 gathers weights into tensors it updates in place, which inference mode forbids
        no_grad = torch.no_grad() if self.sharded else self.device.inference()
        with self.compiler.naming(program, tokens), _compiler_errors(), no_grad:
            return self._forward(tokens).cpu()

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self._embed is not None, f"recipe {self.recipe.name} has no embeddings"
        self._mode(training=False)
        tokens = self.device.put(tokens)
        with self.compiler.naming("embed_step", tokens), _compiler_errors(), self.device.inference():
            return self._embed(tokens).cpu()

    def next_logits(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The logits of the token after each row's first `lengths` tokens of `ids` (rows, seq_len +
        max_new_tokens): one shape for every step of a generation."""
        assert self._next is not None, "the spec generates nothing (inference.generate)"
        self._mode(training=False)
        ids, lengths = self.device.put(ids), self.device.put(lengths)
        with self.compiler.naming("generate_step", ids), _compiler_errors(), self.device.inference():
            return self._next(ids, lengths).cpu()

    def prefill(self, ids: torch.Tensor, starts: torch.Tensor, room: int,
                compiled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The next tokens' logits of prompts that end together (rows, seq_len; each starting at its
        `starts`), and the cache of their keys and values, `room` slots longer, left on the device.
        `compiled=False`: the model's method as it is (a trial of `decode_step` needs only the cache;
        a lazy device, which compiles what it traces, still names the graph the prefill's)."""
        assert self._prefill is not None, "the spec generates nothing with a cache (inference.generate)"
        self._mode(training=False)
        ids, starts = self.device.put(ids), self.device.put(starts)
        prefill = self._prefill if compiled else self.model.prefill
        with self.compiler.naming("prefill_step", ids), _compiler_errors(), self.device.inference():
            logits, cache = prefill(ids, starts, room)
            self.device.sync()  # a lazy device runs it here, the cache made whole, not traced on into the next
            return logits.cpu(), cache

    def decode_next(self, tokens: torch.Tensor, slot: int, starts: torch.Tensor,
                    cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits after one more token per row, written at the cache's `slot`, and the cache then."""
        assert self._decode is not None, "the spec generates nothing with a cache (inference.generate)"
        self._mode(training=False)
        tokens, starts = self.device.put(tokens), self.device.put(starts)
        at = self.device.put(torch.tensor(slot))
        with self.compiler.naming("decode_step", tokens), _compiler_errors(), self.device.inference():
            logits, cache = self._decode(tokens, at, starts, cache)
            self.device.sync()
            return logits.cpu(), cache

    def decoding(self) -> Decoding:
        """How a generation of the spec's gets each next token's logits: through the cache of keys
        and values (`inference.generate.kv_cache`), or from the whole buffer each step."""
        if self._prefill is not None:
            return Caching(self.prefill, self.decode_next)
        return Recomputing(self.next_logits)

    def exercise(self, program: str, steps: int = 1) -> None:
        """Run `program` on inputs of the run's shapes, as a trial run does: for `train_step`,
        `steps` full training steps (forward, backward, optimizer step)."""
        tokens, labels, batch = example_inputs(self.spec, self.recipe)
        if program == "train_step":
            optimizer = self.recipe.optimizer(trainable(self.model), self.spec.train)
            for _ in range(steps):
                self.train_step(tokens, labels, optimizer)
        elif program in ("eval_step", "sharded_eval_step"):
            self.logits(batch)
        elif program == "embed_step":
            if self._embed is not None:
                self.embed(batch)
        elif program in GENERATING:
            generate = self.spec.inference.generate
            assert generate is not None, "the spec generates nothing (inference.generate)"
            if program == "decode_step":  # from a cache made without the prefill's program (prefill_step's)
                uncompiled = functools.partial(self.prefill, compiled=False)
                rehearse(Caching(uncompiled, self.decode_next), self.recipe, batch, generate)
            else:
                rehearse(self.decoding(), self.recipe, batch, generate, steps=0)
        else:
            known = dict.fromkeys((*PROGRAMS, *SHARDED, *GENERATING))
            raise ValueError(f"unknown program {program!r}; the programs are {', '.join(known)}")


def average_gradients(model: nn.Module, group: Any) -> None:
    """Average this rank's gradients with the other replicas' in `group` (what DDP does, for a model
    whose layers are split, which DDP does not wrap): in one flat buffer, one all-reduce. A split
    layer's gradient is this rank's part (of the same part on every replica)."""
    from torch.distributed.tensor import DTensor  # split models only

    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
             for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = flatten(grads)
    torch.distributed.all_reduce(flat, group=group)
    flat /= torch.distributed.get_world_size(group)
    for grad, averaged in zip(grads, unflatten(flat, grads), strict=True):
        grad.copy_(averaged)


def spread(spec: JobSpec, recipe: Recipe, model: nn.Module, device: Device, fsdp: bool) -> Any:
    """Spread `model` over the job's ranks as the spec says, in place: its layers split over
    `train.parallelism.tp` cores (the recipe's `tensor_plan`), then, with `fsdp`, sharded over the
    replicas (each block a unit). The device mesh it was spread over; None for plain ddp."""
    tp = spec.tp
    if tp == 1 and not fsdp:
        return None
    mesh = device.mesh(tp)
    if tp > 1:
        device.split(recipe.tensor_plan(model, tp), mesh)
    if fsdp:
        device.shard(model, recipe.blocks(model), mesh)
    return mesh


def example_inputs(spec: JobSpec, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs and labels of one per-core training batch, and one evaluation/inference batch."""
    gen = torch.Generator().manual_seed(0)
    tokens = recipe.example(spec.per_core_batch, gen)
    if spec.data.packing:  # packed windows: the same tokens, and their positions
        tokens = one_per_window(tokens)
    labels = torch.randint(0, recipe.num_classes or 1, (spec.per_core_batch,), generator=gen)
    batch = recipe.example(spec.inference.batch_size, gen)
    return tokens, labels, batch


def build_model(recipe: Recipe, seed: int) -> nn.Module:
    """The recipe's network: the same seed gives the same initial weights on every rank and backend."""
    torch.manual_seed(seed)
    return recipe.build_model()


def for_run(ctx: WorkerContext, recipe: Recipe, model: nn.Module, ddp: bool = False, sharded: bool = False,
            mesh: Any = None, fsdp: bool = False) -> Programs:
    """The programs of a training, evaluation or inference run: graphs come from the persistent
    compile cache, and any other graph is a recompilation."""
    compiler = ctx.device.compiler(ctx.spec, "run", ctx.log, model=recipe.key)
    return Programs(ctx.spec, recipe, model, compiler, ctx.device, ddp=ddp, sharded=sharded, mesh=mesh, fsdp=fsdp,
                    faults=ctx.faults)


def _spread(spec: JobSpec) -> bool:
    """Whether training spreads the model (fsdp, or tp > 1): its programs are then a sharded model's."""
    layout = spec.layout
    return layout.strategy == "fsdp" or layout.tp > 1


def programs_of(spec: JobSpec) -> tuple[str, ...]:
    """The programs a run of `spec` needs compiled: with sharded or split training, the training
    programs of the spread model besides the evaluate and infer stages' whole ones."""
    generate = spec.inference.generate
    generates = () if generate is None else GENERATING[:2] if generate.kv_cache else GENERATING[2:]
    if _spread(spec):
        return ("train_step", "sharded_eval_step", "eval_step", "embed_step", *generates)
    return (*PROGRAMS, *generates)


def for_trial(spec: JobSpec, recipe: Recipe, compiler: CompileBackend, device: Device, program: str) -> Programs:
    """Fresh programs for a trial run of `program` (ahead-of-time compilation), shaped as the run
    that needs it: a spread model's programs spread as rank 0's are (`Device.mesh`: sharded over a
    group of one, split `tp` ways over a stand-in group)."""
    model = build_model(recipe, spec.train.seed).to(device.torch_device)
    recompute(recipe.blocks(model), spec.train.activation_checkpointing, recipe.saved_ops)  # as training's
    fsdp = spec.layout.strategy == "fsdp"
    if program in SHARDED and _spread(spec):
        mesh = spread(spec, recipe, model, device, fsdp)
        return Programs(spec, recipe, model, compiler, device, sharded=True, mesh=mesh, fsdp=fsdp)
    return Programs(spec, recipe, model, compiler, device)
