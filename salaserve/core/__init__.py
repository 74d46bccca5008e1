"""Types every layer may import: a step's batch, a request, its sampling parameters.

Nothing here imports another salaserve package but `salaserve.config`.
"""
