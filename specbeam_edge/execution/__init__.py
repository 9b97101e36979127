"""Running the models: an ONNX LM's pass over a tree (model.py), batched passes (batch.py), what a
pass returns (heads.py), streamed layers, providers and sessions, the encoder, and the checks
that make exact speculation safe on this machine (invariance.py, integrity.py)."""
