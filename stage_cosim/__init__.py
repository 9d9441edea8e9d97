"""stage-cosim: co-design distributed LLM workloads and the machines that run them.

The pipeline, one package per stage:

    model/      ModelConfig, presets, Hugging Face configs          (what is trained)
    parallel/   ParallelConfig, DeviceMesh                           (how it is split)
    graph/      symbolic tensor graph, costs, derived backward       (one layer, any size)
    sharding/   placements and sharding propagation -> collectives   (one rank's program)
    schedule/   pipeline schedules, ZeRO, step-end reductions        (one stage's step)
    workload.py synthesize(): role graphs for every pipeline stage
    trace/      Chakra writer, reader, validator
    adapters/   simulators that consume workloads (roofline, ASTRA-sim)
    hardware/   GPUs and clusters
    search/     parallelism and hardware search
    cli/        the ``stage-cosim`` command
"""

__version__ = "0.1.0"
