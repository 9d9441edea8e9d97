"""Backends that turn a workload and a cluster into a result: our roofline simulator, ASTRA-sim
(:mod:`stage_cosim.adapters.simulate` picks the network model)."""
