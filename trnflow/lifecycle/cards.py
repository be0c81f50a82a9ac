"""A model's card: the README.md beside an export, saying what the model is, what it was trained
from and on, how the gate judged it, and what made it.

Training writes `card.json` into the export (`ExportCard`), and README.md rendered from it before
the gate has judged; `trnflow models export` renders README.md again into the folder it fills, with
the gate's verdict as the registry recorded it. A LoRA export's adapter folder gets the same card in
place of PEFT's empty template: the adapter is useless without its base, so the card names it first.
"""

from __future__ import annotations

from pydantic import Field

from trnflow import __version__
from trnflow.records import DataRead, RecipeRef, Record

CARD = "card.json"
"""The export's card, as training knew it."""
README = "README.md"


class ExportCard(Record):
    """What training knew of the model it exported."""

    model: str = Field(description="the spec's name")
    run_id: str
    step: int = Field(description="the training steps of its run")
    global_step: int = Field(description="along its lineage")
    recipe: RecipeRef
    precision: str
    data: DataRead
    pretrained: str | None = Field(None, description="the folder its weights started from (model.params.pretrained)")
    base: str | None = Field(None, description="LoRA: the content digest of that folder, which the adapter needs")
    trnflow: str = Field(__version__, description="the trnflow version that trained it")


class CardGate(Record):
    """The gate's verdict on a registered version, as its card shows it."""

    version: int
    status: str | None = Field(description="passed, rejected or worse-than-champion")
    reason: str | None = None
    metrics: dict[str, float | int | None] = Field(default_factory=dict)


def render(card: ExportCard, gate: CardGate | None = None, adapter: bool = False) -> str:
    """The card as Markdown: for the merged (or whole) model, or for the adapter alone (`adapter`)."""
    lora = card.recipe.params.get("lora")
    what = "A LoRA adapter" if adapter else ("A model merged with its LoRA adapter" if lora else "A model")
    lines = [f"# {card.model}", "", f"{what}, trained by trnflow {card.trnflow} (run `{card.run_id}`, "
             f"{card.step} steps, global step {card.global_step}, {card.precision}).", ""]
    if card.pretrained or card.base:
        lines += ["## Base", ""]
        if adapter:
            lines += ["The adapter needs the model it was trained on, unchanged:", ""]
        lines.append(f"- pretrained folder: `{card.pretrained}`" if card.pretrained else "- pretrained folder: none")
        if card.base:
            lines.append(f"- its content digest: `{card.base}` (every file's sha256, as trnflow lists them)")
        if adapter:
            auto = "AutoModelForCausalLM" if card.recipe.recipe == "hf-causal-lm" else "AutoModel"
            load = f'{auto}.from_pretrained("{card.pretrained}")'
            lines += ["", "```python", "from peft import PeftModel", f"from transformers import {auto}", "",
                      f'model = PeftModel.from_pretrained({load}, "<this folder>")', "```"]
        lines.append("")
    lines += ["## Training", "", f"- recipe: `{card.recipe.label()}`"]
    if lora:
        settings = {**lora, "target_modules": lora.get("target_modules") or "every linear layer of the blocks"}
        lines.append(f"- LoRA: {', '.join(f'{k} {v}' for k, v in sorted(settings.items()) if v is not None)}")
    shown = ", ".join(card.data.partitions) if card.data.partitions else "no day partitions"
    files = len(card.data.files)
    lines += [f"- data: {card.data.rows:,} rows from {files} file{'s' if files != 1 else ''} ({shown}; watermark "
              f"{card.data.watermark or 'none'})", "", "## Gate", ""]
    if gate is None:
        lines.append("Not judged when this was written: `trnflow models ls MODEL` shows its verdict, and "
                     "`trnflow models export` writes this card again with it.")
    else:
        lines.append(f"Version {gate.version}: **{gate.status or 'not judged'}**"
                     + (f": {gate.reason}" if gate.reason else "."))
        if gate.metrics:
            lines += ["", "| metric | value |", "|---|---|"]
            lines += [f"| {name} | {value} |" for name, value in sorted(gate.metrics.items())]
    return "\n".join(lines) + "\n"
