"""The engine: the loop that owns the model, admission, scheduling, and the packed forward."""
