"""The spec's gate (the parity gate) and inference (batch inference, with generation) sections."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, model_validator

from trnflow.specs.fields import MAX_STEPS, METRIC_NAME, ReferenceChoice, Section, Url

ABS_DIFF = 0.001
"""The gate's band when a spec sets none: within 0.1% (the M5 rule)."""


class GateSpec(Section):
    """The parity gate: candidate against reference, within max_abs_diff (or max_rel_diff)."""

    reference: ReferenceChoice | None = Field(
        None,
        description="What the candidate is compared with: a metrics JSON file (a previous run's, or another "
        "platform's such as a GPU run); `champion` (the registered champion's series); or `auto`: the fp32 "
        "reference of this spec and its data (the same training in plain fp32, as a GPU run would do it), "
        "which a pipeline run trains itself when none is on record, beside its checkpoints under "
        "`_reference/<digest>`, and the next run of the same spec and data reuses (a retraining judges against "
        "the champion alone). None records a baseline only.",
    )
    metric: str = Field(
        "accuracy", pattern=METRIC_NAME,
        description="Metric compared by the gate: any metric the recipe declares (`trnflow recipes` lists them, "
        "with which way each is better). Against the champion the candidate may be better by any amount.",
    )
    max_abs_diff: float | None = Field(
        None, gt=0, lt=1,
        description="Largest allowed |candidate - reference|: 0.001 (the M5 rule's 0.1%) unless max_rel_diff is set.",
    )
    max_rel_diff: float | None = Field(
        None, gt=0, lt=1,
        description="Largest allowed |candidate - reference| as a share of the reference's value (0.01: 1%), for "
        "metrics such as perplexity where an absolute band means little. Replaces max_abs_diff; set one of them.",
    )
    mode: Literal["every-point", "final"] = Field(
        "every-point",
        description="every-point: each evaluation step both series share must be within max_abs_diff (the M5 "
        "rule); final: only the last shared step.",
    )
    eval_every: int | None = Field(
        None, ge=1, le=MAX_STEPS,
        description="Evaluate on the holdout set every this many training steps (and always at the end)."
    )
    metrics: list[Annotated[str, StringConstraints(pattern=METRIC_NAME)]] = Field(
        default_factory=lambda: ["loss"],
        description="Metrics recorded beside accuracy (and the gate's metric) at each evaluation point: any the "
        "recipe declares.",
    )
    significance: float = Field(
        0.05, gt=0, lt=1, description="Level of the paired McNemar test on per-example predictions."
    )
    fail_on_significant: bool = Field(
        False,
        description="Also fail the gate when McNemar's test finds the candidate and reference differ, even "
        "within max_abs_diff (by default that is reported as a warning). The test pairs per-row correctness, "
        "so it runs when the gate's metric is accuracy.",
    )

    @model_validator(mode="before")
    @classmethod
    def _absolute_unless_relative(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("max_rel_diff") is None and data.get("max_abs_diff") is None:
            return {**data, "max_abs_diff": ABS_DIFF}
        return data

    @model_validator(mode="after")
    def _one_band(self) -> GateSpec:
        if self.max_rel_diff is not None and self.max_abs_diff is not None:
            raise ValueError("gate.max_rel_diff: max_abs_diff is set too; the gate uses one band, so keep "
                             "max_abs_diff for an absolute band or max_rel_diff for a relative one")
        return self


class GenerateSpec(Section):
    """Text generation in batch inference, for a recipe that generates (hf-causal-lm): each row's
    completion of its prompt, written beside what the recipe publishes."""

    max_new_tokens: int = Field(32, ge=1, le=4096, description="Tokens generated per row at most (a row stops at its "
                                "end-of-sequence token).")
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="0: greedy (the most likely token each time); "
                               "above 0: sampled from the probabilities at this temperature.")
    top_k: int | None = Field(None, ge=1, le=1_000_000, description="When sampling: only from the k most likely "
                              "tokens.")
    seed: int = Field(0, ge=0, lt=2**63, description="When sampling: with the row's id, seeds its draws, so a rerun or "
                      "a resumed shard writes the same completions.")
    kv_cache: bool = Field(True, description="Keep each row's keys and values in a cache of fixed size (seq_len + "
                           "max_new_tokens): the prompts computed once (the prefill_step program), then one token a "
                           "step (decode_step). false: every step computes the whole buffer again (generate_step), "
                           "for a decoder that does not take positions and an attention mask as given (llama, qwen2, "
                           "qwen3 and gpt2 do).")


class InferenceSpec(Section):
    """Offline batch inference: embeddings written as Parquet shards."""

    output_url: Url = Field(description="Directory or s3:// URL for the Parquet shards.")
    shard_size: int = Field(10_000, ge=1, le=100_000_000, description="Rows per output shard.")
    batch_size: int = Field(256, ge=1, le=2**20, description="Rows per forward pass.")
    generate: GenerateSpec | None = Field(None, description="Also generate each row's completion (hf-causal-lm), "
                                          "greedy unless a temperature is set.")
