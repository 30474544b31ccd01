"""Turns scheduled work into device tensors (``ForwardInputs``), runs the model, samples."""
