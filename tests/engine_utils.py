"""Helpers for tests that drive an Engine directly."""


def run_requests(engine, prompts, params) -> dict[str, list[int]]:
    """Add every prompt as request r0, r1, ... with the same params, step the engine until all
    finish, and return each request's output tokens."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.rid, []).extend(o.new_token_ids)
    return outs
