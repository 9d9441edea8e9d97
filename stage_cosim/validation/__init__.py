"""Published measurements the performance model is calibrated and checked against."""
