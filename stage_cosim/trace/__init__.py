"""Chakra traces: writing, reading, validating."""
