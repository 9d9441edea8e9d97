"""Our analytical simulator: event-driven replay with a roofline GPU model and the calibrated
network model. It never imports the ASTRA-sim package, which builds on it."""
