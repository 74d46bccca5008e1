"""`salaserve serve`: parse SGLang-style flags, start uvicorn; the app starts the engine process.

The port is checked before anything else starts, so a port in use is one clear error and no
engine process is spawned. /health answers 503 until the engine has loaded the model and (unless
--skip-server-warmup) run a warm-up generation, then 200. If the engine fails to start or dies,
the server exits with status 1 rather than answering errors forever; on shutdown the engine
process is stopped. With --dp-size N there are N engines (server/replicas.py): all must start,
and the server exits once none is left serving.
"""

from __future__ import annotations

import logging
import os
import socket
import sys

from salaserve.server.args import parse_args

log = logging.getLogger("salaserve.server")

# SGLang's switch for a --context-length above the model's own limit; read here, in the command
# line layer, and nowhere else.
ALLOW_LONGER_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


def env_flag(name: str) -> bool:
    """True for 1 / true / yes / y, as SGLang's boolean environment variables."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "y")


def context_length_error(context_length: int | None, model_dir: str, allow_longer: bool) -> str | None:
    """SGLang refuses a --context-length above the model's max_position_embeddings unless
    SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN is set (then it warns): positions past what the model
    was trained on may give wrong outputs."""
    if context_length is None:
        return None
    from salaserve.config import ConfigError, ModelConfig

    try:
        model_max = ModelConfig.from_pretrained(model_dir).max_position_embeddings
    except ConfigError:  # a broken config.json: the engine's start-up reports it
        return None
    if context_length <= model_max:
        return None
    message = (f"--context-length {context_length} is greater than the model's max_position_embeddings "
               f"({model_max}); outputs past {model_max} tokens may be wrong.")
    if allow_longer:
        log.warning("%s Allowed by %s.", message, ALLOW_LONGER_CONTEXT_ENV)
        return None
    return f"{message} To allow it, set the environment variable {ALLOW_LONGER_CONTEXT_ENV}=1 (as in SGLang)."


def check_port(host: str, port: int) -> int:
    """`port`, or for port 0 one the system picks, after checking that it can be bound (as
    SGLang checks before it starts). Raises OSError. uvicorn binds it again once the app has
    started: handing it this socket instead made uvicorn reset connections whose request body
    it had refused (413) before the client read the response."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        return sock.getsockname()[1]


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
    if error := context_length_error(engine_args.context_length, server_args.model_path,
                                     env_flag(ALLOW_LONGER_CONTEXT_ENV)):
        print(f"salaserve serve: error: {error}", file=sys.stderr)
        return 2
    from salaserve.server.replicas import replica_devices

    try:
        devices = replica_devices(engine_args.device, server_args.dp_size)
        if engine_args.tp_size > 1:  # refused here rather than by the engine process after start-up
            from salaserve.engine.tp_workers import check_layout

            check_layout(engine_args, server_args.model_path)
    except ValueError as e:
        print(f"salaserve serve: error: {e}", file=sys.stderr)
        return 2
    try:
        server_args.port = check_port(server_args.host, server_args.port)
    except OSError as e:
        reason = os.strerror(e.errno).lower() if e.errno else str(e)
        print(f"salaserve serve: error: cannot listen on {server_args.host}:{server_args.port}: {reason}",
              file=sys.stderr)
        return 1

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
