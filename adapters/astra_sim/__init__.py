"""ASTRA-sim: drive a user's build (export run directories, run the binary, parse its output),
and reproduce its analytical backend exactly (the ``astra`` network model), on top of the
simulator (:mod:`stage_cosim.adapters.roofline`)."""
