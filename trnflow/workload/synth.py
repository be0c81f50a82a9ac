"""Synthetic product reviews with a learnable sentiment signal, label noise and day-to-day drift.

Each review mentions a product and a few aspects, with sentiment words whose polarity decides the
label; negation ("not great") flips a phrase. A fraction of labels is flipped at random (noise).
Day by day the catalogue drifts: new products appear and the mix of sentiment words shifts, so an
incremental run on new partitions has something new to learn.

Layout written under OUT:

    train/dt=YYYY-MM-DD/part-00000.<fmt>   one partition per day
    holdout/part-00000.<fmt>               drawn like the last day
    inference/part-00000.<fmt>             unlabelled rows to embed

The `prompt-completion` format writes the same reviews as JSONL rows for a language model: the
review as the prompt ("Review: ...\nSentiment:") and its label's word as the completion
(" positive" or " negative"), in every set, so that a fine-tuned model has something real to learn
and batch inference scores each completion given its prompt. The `chat` format writes them as chats
(a `messages` list of role/content turns): a system instruction, the review from the user and the
sentiment's word from the assistant, and on every third row a second exchange in which the user
asks again and the assistant repeats the word in a sentence.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from trnflow.fsutil import atomic_write_bytes

POSITIVE = ["great", "excellent", "sturdy", "reliable", "comfortable", "fast", "beautiful", "quiet",
            "durable", "perfect", "bright", "smooth", "handy", "solid", "lovely", "crisp"]
NEGATIVE = ["broken", "flimsy", "slow", "noisy", "cheap", "disappointing", "useless", "leaky",
            "faulty", "awful", "dull", "scratched", "wobbly", "weak", "sticky", "late"]
ASPECTS = ["battery", "screen", "handle", "lid", "strap", "motor", "case", "cable", "finish", "fabric",
           "sound", "grip", "packaging", "delivery", "zipper", "button"]
PRODUCTS = ["kettle", "blender", "headphones", "backpack", "lamp", "toaster", "keyboard", "charger",
            "jacket", "speaker", "mug", "drill", "umbrella", "monitor", "watch", "tent", "mixer", "fan",
            "router", "camera", "scooter", "pillow", "skillet", "thermos"]
FILLER = ["the", "this", "my", "arrived", "after", "a", "week", "overall", "honestly", "really", "and",
          "it", "was", "is", "for", "price", "would", "buy", "again", "use", "daily", "with"]
INTENSIFIERS = ["very", "really", "super", "quite", "extremely"]


def _phrase(rng: random.Random, positive: bool, day: int) -> str:
    # Drift: later days lean on the later half of each word list.
    pool = POSITIVE if positive else NEGATIVE
    lo = min(len(pool) // 2, day)
    word = pool[rng.randrange(lo, len(pool))]
    aspect = rng.choice(ASPECTS)
    if rng.random() < 0.15:  # negated phrase: the word carries the opposite polarity
        opposite = NEGATIVE if positive else POSITIVE
        return f"the {aspect} is not {rng.choice(opposite)}"
    if rng.random() < 0.3:
        word = f"{rng.choice(INTENSIFIERS)} {word}"
    return f"{aspect} {word}"


def review(rng: random.Random, day: int) -> tuple[str, int]:
    label = rng.random() < 0.5
    products = PRODUCTS[: 12 + min(day * 2, len(PRODUCTS) - 12)]
    parts = [f"{rng.choice(FILLER)} {rng.choice(products)}"]
    for _ in range(rng.randint(2, 4)):
        # Most phrases agree with the label; some are mixed, which makes the task non-trivial.
        parts.append(_phrase(rng, label if rng.random() < 0.85 else not label, day))
        parts.append(" ".join(rng.choices(FILLER, k=rng.randint(1, 4))))
    rng.shuffle(parts)
    return " ".join(parts), int(label)


def _rows(rng: random.Random, day: int, n: int, prefix: str, noise: float) -> list[dict]:
    rows = []
    for i in range(n):
        text, label = review(rng, day)
        if rng.random() < noise:
            label = 1 - label
        rows.append({"id": f"{prefix}-{i:07d}", "text": text, "label": label})
    return rows


def _polarity_csv(rows: list[dict]) -> bytes:
    """The Amazon Polarity layout: no header; label 1 (negative) or 2 (positive), title, content."""
    out = io.StringIO()
    writer = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
    for r in rows:
        words = r["text"].split()
        writer.writerow([r.get("label", 0) + 1, " ".join(words[:3]), " ".join(words[3:])])
    return out.getvalue().encode()


PROMPT_COMPLETION = "prompt-completion"
WORDS = (" negative", " positive")
"""A label's completion."""


def prompt_completion(row: dict) -> dict:
    """A review as a language model's prompt and its label's word as the completion."""
    return {"id": row["id"], "prompt": f"Review: {row['text']}\nSentiment:", "completion": WORDS[row["label"]]}


CHAT = "chat"
INSTRUCTION = "Say whether the customer's review is positive or negative, in one word."


def chat(row: dict, n: int) -> dict:
    """A review as a chat: the instruction, the review and its label's word, and on every third row
    (by `n`) a second exchange."""
    word = WORDS[row["label"]].strip()
    messages = [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": row["text"]},
                {"role": "assistant", "content": word}]
    if n % 3 == 2:
        messages += [{"role": "user", "content": "Are you sure?"},
                     {"role": "assistant", "content": f"Yes: the review is {word}."}]
    return {"id": row["id"], "messages": messages}


def _encode(rows: list[dict], fmt: str) -> bytes:
    if fmt == "amazon-polarity":
        return _polarity_csv(rows)
    if fmt == PROMPT_COMPLETION:
        return "".join(json.dumps(prompt_completion(r)) + "\n" for r in rows).encode()
    if fmt == CHAT:
        return "".join(json.dumps(chat(r, n)) + "\n" for n, r in enumerate(rows)).encode()
    if fmt == "jsonl":
        return "".join(json.dumps(r) + "\n" for r in rows).encode()
    table = pa.Table.from_pylist(rows)
    sink = io.BytesIO() if fmt == "csv" else pa.BufferOutputStream()
    if fmt == "csv":
        pacsv.write_csv(table, sink)
        return sink.getvalue()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def synthesize(out: Path, days: int, rows_per_day: int, seed: int, fmt: str = "jsonl",
               holdout_rows: int | None = None, inference_rows: int | None = None,
               noise: float = 0.05, start: dt.date = dt.date(2026, 1, 1), train_only: bool = False) -> dict:
    """Write the three datasets (with `train_only`, just the day partitions: a new day arriving);
    returns a summary of what was written."""
    rng = random.Random(seed)
    ext = {"amazon-polarity": "csv", PROMPT_COMPLETION: "jsonl", CHAT: "jsonl"}.get(fmt, fmt)
    holdout_rows = holdout_rows if holdout_rows is not None else rows_per_day
    inference_rows = inference_rows if inference_rows is not None else rows_per_day
    written = []
    for day in range(days):
        date = (start + dt.timedelta(days=day)).isoformat()
        path = out / "train" / f"dt={date}" / f"part-00000.{ext}"
        atomic_write_bytes(path, _encode(_rows(rng, day, rows_per_day, f"tr-{date}", noise), fmt))
        written.append(path)
    if train_only:
        return {"train_partitions": len(written), "train_rows": days * rows_per_day, "holdout_rows": 0,
                "inference_rows": 0, "out": str(out)}
    last = days - 1
    holdout = out / "holdout" / f"part-00000.{ext}"
    atomic_write_bytes(holdout, _encode(_rows(rng, last, holdout_rows, "ho", noise), fmt))
    unlabelled = _rows(rng, last, inference_rows, "inf", 0)
    inference_rows_data = unlabelled if fmt in (PROMPT_COMPLETION, CHAT) else [{"id": r["id"], "text": r["text"]}
                                                                               for r in unlabelled]
    inference = out / "inference" / f"part-00000.{ext}"
    atomic_write_bytes(inference, _encode(inference_rows_data, fmt))
    return {"train_partitions": len(written), "train_rows": days * rows_per_day,
            "holdout_rows": holdout_rows, "inference_rows": inference_rows, "out": str(out)}
