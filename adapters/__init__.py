"""Backends that turn a workload and a cluster into a result: our roofline simulator, ASTRA-sim
(:mod:`stage_cosim.adapters.simulate` picks the network model)."""

# The simulators a step can run on (--backend): the built-in one and a user's ASTRA-sim binary.
BACKENDS = ("roofline", "astra-sim")
