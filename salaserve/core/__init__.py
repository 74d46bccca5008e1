"""Types every layer may import: a step's batch, a request, its sampling parameters, the
checkpoint's tensor layout.

Nothing here imports another salaserve package but `salaserve.config`.
"""
