"""`salaserve serve`: parse SGLang-style flags, start uvicorn; the app starts the engine process.

/health answers 503 until the engine has loaded the model and (unless --skip-server-warmup) run
a warm-up generation, then 200. If the engine fails to start or dies, the server exits with
status 1 rather than answering errors forever; on shutdown the engine process is stopped. With
--dp-size N there are N engines (server/replicas.py): all must start, and the server exits once
none is left serving.
"""

from __future__ import annotations

import logging
import os
import sys

from salaserve.server.args import parse_args

log = logging.getLogger("salaserve.server")


def run(argv: list[str]) -> int:
    engine_args, server_args, notices = parse_args(argv)
    level = getattr(logging, server_args.log_level.upper(), logging.INFO)
    logging.getLogger().setLevel(level)
    for notice in notices:
        print(notice, file=sys.stderr)

    if server_args.model_path is None:
        from salaserve.model.default import default_model_dir

        server_args.model_path = default_model_dir()
        log.info("no --model-path: serving the built-in default model at %s", server_args.model_path)
    elif not os.path.isfile(os.path.join(server_args.model_path, "config.json")):
        print(f"salaserve serve: error: --model-path {server_args.model_path!r} is not a model directory "
              "(no config.json)", file=sys.stderr)
        return 2
    engine_args.model = server_args.model_path
    from salaserve.server.replicas import replica_devices

    try:
        devices = replica_devices(engine_args.device, server_args.dp_size)
    except ValueError as e:
        print(f"salaserve serve: error: {e}", file=sys.stderr)
        return 2

    import uvicorn

    from salaserve.server.app import create_app
    from salaserve.server.http_limits import MAX_HEAD_BYTES, guarded_protocol

    fatal: list[str] = []
    server: uvicorn.Server | None = None

    def on_fatal(message: str) -> None:
        fatal.append(message)
        if server is not None:
            server.should_exit = True

    app = create_app(server_args, engine_args, on_fatal=on_fatal, devices=devices)
    # proxy_headers off: X-Forwarded-For must not let a client pose as another address (request
    # owners, auth.py); requests through a local proxy then all share the proxy's address
    config = uvicorn.Config(app, host=server_args.host, port=server_args.port, log_level=server_args.log_level,
                            access_log=level <= logging.DEBUG, timeout_graceful_shutdown=5,
                            timeout_keep_alive=30, backlog=4096, proxy_headers=False,
                            http=guarded_protocol(server_args.request_read_timeout),
                            h11_max_incomplete_event_size=MAX_HEAD_BYTES)
    server = uvicorn.Server(config)
    server.run()
    if fatal:
        print(f"salaserve serve: stopped: {fatal[0]}", file=sys.stderr)
        return 1
    return 0
