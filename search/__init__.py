"""Search over parallelizations and hardware designs."""
