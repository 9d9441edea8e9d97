"""Serving simulation: a stream of requests on a serving engine, step times from the simulator.

requests ──► engine (continuous batching, chunked prefill, paged KV cache, optional
              disaggregated prefill and decode pools)
         ──► step times (the simulator on each step's batch shape, cached)
         ──► metrics (TTFT, TPOT/ITL, end-to-end latency, throughput, goodput under SLOs)
"""
