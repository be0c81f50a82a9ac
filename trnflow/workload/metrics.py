"""Classification metrics on a whole holdout set: accuracy, loss, F1 and ROC AUC.

Two classes: F1 and AUC of class 1 (the positive class). More classes: macro averages over the
classes, AUC one-vs-rest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def f1_score(predicted: torch.Tensor, labels: torch.Tensor, num_classes: int) -> float:
    classes = [1] if num_classes == 2 else range(num_classes)
    scores = []
    for c in classes:
        tp = ((predicted == c) & (labels == c)).sum().item()
        fp = ((predicted == c) & (labels != c)).sum().item()
        fn = ((predicted != c) & (labels == c)).sum().item()
        scores.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 1.0)
    return sum(scores) / len(scores)


def _binary_auc(scores: torch.Tensor, positive: torch.Tensor) -> float | None:
    """The Mann-Whitney statistic: the chance that a random positive outscores a random negative
    (ties count half). None when one class is absent."""
    n_pos = int(positive.sum())
    n_neg = len(positive) - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    _, inverse, counts = torch.unique(scores.double(), return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    average_rank = ends - (counts.double() - 1) / 2  # 1-based ranks, ties share their mean
    rank_sum = average_rank[inverse][positive].sum().item()
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def roc_auc(probabilities: torch.Tensor, labels: torch.Tensor) -> float | None:
    num_classes = probabilities.shape[1]
    classes = [1] if num_classes == 2 else range(num_classes)
    values = [v for c in classes if (v := _binary_auc(probabilities[:, c], labels == c)) is not None]
    return sum(values) / len(values) if values else None


def classification_metrics(logits: torch.Tensor, labels: torch.Tensor, names: list[str]) -> dict[str, float | None]:
    """Accuracy, and each of `names` (loss, f1, auc), for logits of shape (rows, classes)."""
    logits = logits.double()
    predicted = logits.argmax(-1)
    out: dict[str, float | None] = {"accuracy": (predicted == labels).double().mean().item()}
    if "loss" in names:
        out["loss"] = F.cross_entropy(logits, labels).item()
    if "f1" in names:
        out["f1"] = f1_score(predicted, labels, logits.shape[1])
    if "auc" in names:
        out["auc"] = roc_auc(logits.softmax(-1), labels)
    return out
