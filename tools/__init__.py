"""Developer tools, run from the repository root (`python -m tools.NAME`): training and evaluating
the small models and their tokenizer, the full-size check, the speculative acceptance measure.

They import salaserve; nothing in salaserve imports them.
"""
