"""What a 64-node job costs to plan: building, for 64 trn1.32xlarge nodes (2,048 NeuronCores), the
SageMaker training-job request, the Batch job definition and SubmitJob request, the emulator's
topology (every rank's placement, the ring order, and `neuron-ls`'s records for every node), and the
ring and tree plans of all-reduce, all-gather and reduce-scatter. Goal: all of it in under 100 ms.

The spec is the trn1.32xlarge example (`jobspecs/examples/trn1-32xl-incremental.yaml`) with
`compute.nodes: 64`; each part is timed on its own, `--repeats` times, and the medians are reported.

    python benchmarks/scale_topology.py [--nodes 64] [--repeats 20] [--size 64MB] [--limit-ms 100]

The last line printed is JSON (`_report`'s shape), with {"nodes", "cores", "build_ms": {"sagemaker",
"batch", "topology", "plans"}, "total_ms", "limit_ms", "within"}. It exits 1 when the
total is over the limit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from _report import emit, limit_figure

from trnflow.backends import JobRequest
from trnflow.backends.batch_request import build_job_definition, build_submit_job
from trnflow.backends.cloud import CloudTarget
from trnflow.backends.sagemaker_request import build_training_job_request
from trnflow.cli.render import parse_size
from trnflow.neuron.plan import ALGORITHMS, OPS, Topology, build_plan, job_topology
from trnflow.neuron.topology import neuron_ls
from trnflow.specs import JobSpec, load_spec

EXAMPLE = Path(__file__).resolve().parents[1] / "jobspecs" / "examples" / "trn1-32xl-incremental.yaml"
TARGET = CloudTarget(image="123456789012.dkr.ecr.us-east-1.amazonaws.com/trnflow:bench",
                     staging_url="s3://bench-staging/trnflow", role_arn="arn:aws:iam::123456789012:role/bench",
                     job_queue="bench-queue")


def sagemaker(spec: JobSpec) -> None:
    """The SageMaker CreateTrainingJob request of the training stage."""
    build_training_job_request(JobRequest(spec, "train", "bench"), TARGET)


def batch(spec: JobSpec) -> None:
    """The Batch job definition and the SubmitJob request of the training stage."""
    definition = build_job_definition(spec, TARGET)
    build_submit_job(JobRequest(spec, "train", "bench"), TARGET, definition["jobDefinitionName"])


def topology(spec: JobSpec) -> Topology:
    """The job's placements and ring order, and every node's `neuron-ls` records."""
    built = job_topology(spec)
    for _ in range(built.nodes):
        neuron_ls(built.instance_type)
    return built


def plans(built: Topology, size: int) -> None:
    """Every op's plan by every algorithm, with the figures a report shows."""
    for op in OPS:
        for algorithm in ALGORITHMS:
            build_plan(built, op, algorithm, size).summary()


def timed(build: Callable[[], object]) -> float:
    """Milliseconds `build` takes once."""
    began = time.perf_counter()
    build()
    return (time.perf_counter() - began) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--size", default="64MB", help="the collective plans' buffer")
    parser.add_argument("--limit-ms", type=float, default=100.0)
    args = parser.parse_args()
    spec = load_spec(EXAMPLE, {"compute.nodes": args.nodes})
    size = parse_size(args.size)
    built = job_topology(spec)
    parts: dict[str, list[float]] = {"sagemaker": [], "batch": [], "topology": [], "plans": []}
    totals = []
    for _ in range(args.repeats):
        took = {"sagemaker": timed(lambda: sagemaker(spec)), "batch": timed(lambda: batch(spec)),
                "topology": timed(lambda: topology(spec)), "plans": timed(lambda: plans(built, size))}
        for name, ms in took.items():
            parts[name].append(ms)
        totals.append(sum(took.values()))
    medians = {name: round(statistics.median(values), 2) for name, values in parts.items()}
    total = round(statistics.median(totals), 2)
    within = total <= args.limit_ms
    print(f"{spec.compute.nodes} x {spec.compute.instance_type} ({built.ranks} NeuronCores): "
          + ", ".join(f"{name} {ms:.2f} ms" for name, ms in medians.items())
          + f"; total {total:.2f} ms (median of {args.repeats}, slowest {max(totals):.2f} ms), "
          + f"{'within' if within else 'over'} the {args.limit_ms:g} ms limit")
    emit("scale_topology", [limit_figure(f"plan a {built.ranks}-core job", totals, args.limit_ms, unit="ms")],
         nodes=spec.compute.nodes, cores=built.ranks, build_ms=medians, total_ms=total, limit_ms=args.limit_ms,
         within=within)
    if not within:
        sys.exit(1)


if __name__ == "__main__":
    main()
