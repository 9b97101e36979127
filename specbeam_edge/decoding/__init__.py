"""The search: token trees, drafters, beam search, sampling and constraints, the KV cache of a
request's tree, and the scheduler that serves every request's passes (start from protocol.py)."""
