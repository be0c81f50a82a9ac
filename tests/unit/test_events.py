"""The ranks' JSON event lines, read back and put in words for a run's log."""

import json

from trnflow.events import parse_event, readable


def _line(**fields) -> str:
    return json.dumps({"ts": 1764280000.123, "rank": 0, **fields})


def test_events_read_as_a_person_reads_progress():
    train = parse_event(_line(event="train", steps=300, step=100, global_step=100, loss=0.37595921,
                              samples_per_s=1315.2, graphs=2))
    assert readable(train) == "train: step 100/300, mean loss 0.3760, 1,315 samples/s, global step 100, graphs 2"
    shard = parse_event(_line(event="infer_shard", rank=1, shard=0, shards=4, rows=500, reused=False,
                              rows_per_s=6391.2))
    assert readable(shard) == "infer_shard (rank 1): shard 1/4, rows 500, reused false, rows per s 6,391.2"
    point = parse_event(_line(event="evaluate", step=20, accuracy=0.81234567, loss=None))
    assert readable(point) == "evaluate: step 20, accuracy 0.8123, loss none"
    long = readable(parse_event(_line(event="recompile", shapes=[[16, 32]] * 100)))
    assert len(long) < 200 and long.endswith("…")


def test_neuron_parallel_compiles_summary_is_its_counts():
    summary = {"compilation_summary": {"hit": 1, "done": 2, "failed": 0, "locked": 0},
               "compilation_report": {"MODULE_x+y": {"program": "train_step", "status": "done"}}}
    event = parse_event("INFO ||NEURON_PARALLEL_COMPILE||: " + json.dumps(summary))
    assert readable(event) == "compile_summary: hit 1, done 2, failed 0, locked 0"


def test_other_output_is_no_event():
    for line in ("INFO ||NEURON_CACHE||: Current remaining items are 3", "{not json", "[1, 2]", '{"no": "event"}',
                 "Traceback (most recent call last):", "INFO ||NEURON_PARALLEL_COMPILE||: {broken"):
        assert parse_event(line) is None
