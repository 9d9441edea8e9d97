"""Drive a user's ASTRA-sim build: export run directories, run the binary, parse its output."""
