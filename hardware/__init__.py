"""Hardware descriptions: GPUs and clusters (real presets and hypothetical ones)."""
