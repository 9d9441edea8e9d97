"""Our analytical simulator: event-driven replay with a roofline GPU model and two network models."""
