"""`trnflow checkpoint`: look at a checkpoint, and join a sharded one into a plain `model.pt`."""
from __future__ import annotations

import json
from typing import Annotated

import typer

from trnflow.cli.console import RED, cli_console
from trnflow.errors import ExitCode, TrnflowError
from trnflow.redact import without_credentials
from trnflow.urls import normalise_url

checkpoint_app = typer.Typer(help="Look at checkpoints, and consolidate sharded ones.", no_args_is_help=True)
console = cli_console()
err = cli_console(stderr=True)
UrlArg = Annotated[str, typer.Argument(help="A checkpoint: its step folder, as a directory, file:// or s3:// URL "
                                       "(for example <checkpoint_url>/<run id>/step-000040).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


def _fail(url: str, message: str) -> typer.Exit:
    err.print(f"{without_credentials(url)}: {message}" if url not in message else message, **RED)
    return typer.Exit(ExitCode.BAD_INPUT)


@checkpoint_app.command("consolidate")
def consolidate_command(url: UrlArg, as_json: JsonOpt = False):
    """Join a sharded checkpoint (`train.parallelism.strategy: fsdp`) into one `model.pt` beside its
    shards, the whole weights as a plain state_dict that any PyTorch program loads; the checkpoint's
    marker then lists it. A run's last checkpoint holds one already; a whole checkpoint is left as it is."""
    from trnflow.workload.checkpoint import consolidate, weights_digest  # torch: only when a command needs it

    url = normalise_url(url)
    try:
        model_url, written, ckpt = consolidate(url)
        digest = weights_digest(ckpt.model)
    except TrnflowError as exc:
        raise _fail(url, str(exc)) from None
    except (OSError, ValueError) as exc:
        raise _fail(url, f"{type(exc).__name__}: {exc}") from None
    tensors = sum(t.numel() for t in ckpt.model.values())
    if as_json:
        print(json.dumps({"checkpoint": url, "model": model_url, "written": written, "sharded": ckpt.sharded,
                          "step": ckpt.step, "parameters": tensors, "weights_sha256": digest}, indent=2))
        return
    if not ckpt.sharded:
        console.print(f"{without_credentials(url)} is not sharded: its model.pt is whole already")
    elif written:
        console.print(f"wrote {without_credentials(model_url)}: {tensors:,} parameters, joined from "
                      f"{len(ckpt.shards or {}) - 1} shard(s)")
    else:
        console.print(f"{without_credentials(model_url)} was there already ({tensors:,} parameters)")
    console.print("load it with torch.load(path, weights_only=True) and model.load_state_dict(...)", style="dim")
