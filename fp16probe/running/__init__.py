"""Running: load a model, make its inputs and loss, and run the probed steps."""
