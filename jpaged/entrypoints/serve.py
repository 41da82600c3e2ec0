"""`jpaged serve`: serves a model over an OpenAI-compatible HTTP API (jpaged.entrypoints.openai).

    jpaged serve [--config my_config.py] [--host 127.0.0.1] [--port 8000] \
        [--config.max_num_seqs=16 --config.max_queued_requests=64 ...] [--precompile]

(also `python scripts/serve.py ...` in a checkout).  Without --config it serves
the package's default config (jpaged.entrypoints.cli_config: the embedded
SmolLM2-135M-Instruct).  Every config field can be overridden as
--config.field=value, as in `jpaged batch`; the config is checked before jax loads (a bad one exits 2 with
one line).  The server binds at once and builds the engine in the background:
GET /health answers 503 until the engine is ready, then 200.  On SIGTERM (or
SIGINT) it stops accepting connections, gives the requests in flight
shutdown_grace_seconds to finish while GET /health and new requests get 503
(it keeps listening meanwhile, so a load balancer sees the 503 and moves on),
aborts what is left and exits 0.

--api_key (or the environment's JPAGED_API_KEY) makes every route but /health
(and /metrics, unless --metrics_require_key) ask for `Authorization: Bearer
<key>`; serving a non-loopback address without one logs a warning.  The request
and connection limits (--max_request_body_bytes, --max_prompt_bytes,
--body_timeout_seconds, --header_timeout_seconds, --timeout_keep_alive,
--limit_concurrency, --backlog) are jpaged.entrypoints.openai.state.ServerOptions.

LoRA adapters: --config.lora_modules=name=path[,name=path...] loads PEFT
directories at start (--config.max_loras: slots for more); a request names one
as its "model", /v1/models lists them, and POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (vLLM's routes) change them at run time.  Those two
are always on, behind the API key like every other route: set a key before
serving them beyond this machine (a path they name is read from its disk).

--enable_rl_routes turns on the routes RL frameworks (verl, slime, OpenRLHF)
call on a rollout server: POST /pause, /resume, /sleep, /wake_up,
/update_weights, /reset_prefix_cache and GET /is_paused, /is_sleeping
(jpaged.entrypoints.openai.admin).  They change the engine for every client (and
/update_weights reads a path on this machine's disk): off by default (404),
behind the API key when on.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import signal
import sys
import time
from typing import Any

from absl import app, flags, logging

from jpaged.core.config import ConfigError, apply_overrides, default_config, validate_config
from jpaged.entrypoints import cli


@dataclasses.dataclass(frozen=True)
class Args:
    """The command line besides --config (see define_flags)."""

    host: str = "127.0.0.1"
    port: int = 8000
    precompile: bool = False
    served_model_name: str | None = None
    access_log: bool = True
    api_key: str | None = None              # None: JPAGED_API_KEY if set, else no key
    metrics_require_key: bool = False
    max_request_body_bytes: int | None = None
    max_prompt_bytes: int | None = None
    body_timeout_seconds: float = 30.0
    header_timeout_seconds: float = 10.0
    timeout_keep_alive: float = 5.0
    limit_concurrency: int | None = None
    backlog: int = 2048
    enable_rl_routes: bool = False
    disable_additional_properties: bool = False


def define_flags() -> tuple[flags.FlagHolder, dict[str, flags.FlagHolder]]:
    """Defines the command's absl flags (once per process): --config and those of Args."""
    config = cli.define_config_flag()
    holders = {
        "host": flags.DEFINE_string("host", Args.host, "Address to listen on (0.0.0.0: every interface)."),
        "port": flags.DEFINE_integer("port", Args.port, "Port to listen on."),
        "precompile": flags.DEFINE_bool("precompile", False, "Build the power-of-two step buckets (and the "
                                        "largest) before /health turns 200; the others build in the "
                                        "background, their steps padded to the next ready bucket meanwhile "
                                        "(default: each is built the first time a step needs it)."),
        "served_model_name": flags.DEFINE_string("served_model_name", None, "The model name clients send "
                                                 "(default: the config's model)."),
        "access_log": flags.DEFINE_bool("access_log", True, "Log one line per HTTP request."),
        "api_key": flags.DEFINE_string("api_key", None, "Clients must send 'Authorization: Bearer <key>' on "
                                       "every route but /health (default: the environment's JPAGED_API_KEY; "
                                       "neither: no key)."),
        "metrics_require_key": flags.DEFINE_bool("metrics_require_key", False, "/metrics asks for the key too."),
        "max_request_body_bytes": flags.DEFINE_integer("max_request_body_bytes", None, "Larger bodies get a 413 "
                                                       "(default: max(16 MiB, 4 * max_prompt_bytes))."),
        "max_prompt_bytes": flags.DEFINE_integer("max_prompt_bytes", None, "Bytes of text per prompt (a chat: "
                                                 "its messages) before tokenizing; more is a 400 (default: "
                                                 "max(64 KiB, 64 * max_model_len))."),
        "body_timeout_seconds": flags.DEFINE_float("body_timeout_seconds", Args.body_timeout_seconds,
                                                   "A body not all received within this is a 408."),
        "header_timeout_seconds": flags.DEFINE_float("header_timeout_seconds", Args.header_timeout_seconds,
                                                     "A connection whose request line and headers take longer "
                                                     "is closed."),
        "timeout_keep_alive": flags.DEFINE_float("timeout_keep_alive", Args.timeout_keep_alive,
                                                 "Idle keep-alive connections are closed after this."),
        "limit_concurrency": flags.DEFINE_integer("limit_concurrency", None, "Connections + requests before "
                                                  "new ones get 503 (default: 2 * (max_queued_requests + "
                                                  "max_num_seqs * data_parallel_size) + 64)."),
        "backlog": flags.DEFINE_integer("backlog", Args.backlog, "The listening socket's accept queue."),
        "enable_rl_routes": flags.DEFINE_bool("enable_rl_routes", False, "Serve the RL rollout routes "
                                              "(/pause, /resume, /sleep, /wake_up, /is_paused, /is_sleeping, "
                                              "/update_weights, /reset_prefix_cache): they change the engine "
                                              "for every client; behind the API key."),
        "disable_additional_properties": flags.DEFINE_bool(
            "disable_additional_properties", False, "Objects of response and tool parameter JSON schemas that "
            "list properties and say nothing of additionalProperties take no other keys (vLLM's option); a "
            "request's own disable_additional_properties wins."),
    }
    cli.register_key_flags([config, *holders.values()])
    return config, holders


def build_engine(config: Any, precompile: bool) -> Any:
    """The engine (in the server's loader thread: jax loads here)."""
    from jpaged.engine.router import create_engine
    t0 = time.perf_counter()
    llm = create_engine(config)
    if precompile:
        llm.precompile()
    print(f"engine ready in {time.perf_counter() - t0:.1f} s: {llm.loaded.source}, {llm.num_blocks} KV blocks "
          f"x {config.block_size} tokens, {llm.kv_dtype.name}, attention {llm.attention_impl}", flush=True)
    return llm


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def open_address_warning(host: str, api_key: str | None) -> str | None:
    """The start-up warning for serving a non-loopback address without a key."""
    if api_key or is_loopback(host):
        return None
    return (f"serving {host} without an API key: anyone who can reach this address can use the model "
            "(set --api_key or JPAGED_API_KEY)")


def server_options(args: Args, environ: Any = os.environ) -> Any:
    """The ServerOptions of these arguments (the API key from JPAGED_API_KEY if
    --api_key is not given; an empty key is no key)."""
    from jpaged.entrypoints.openai.state import ServerOptions
    key = args.api_key if args.api_key is not None else environ.get("JPAGED_API_KEY")
    return ServerOptions(api_key=key or None, metrics_require_key=args.metrics_require_key,
                         max_request_body_bytes=args.max_request_body_bytes, max_prompt_bytes=args.max_prompt_bytes,
                         body_timeout_seconds=args.body_timeout_seconds,
                         header_timeout_seconds=args.header_timeout_seconds,
                         timeout_keep_alive=args.timeout_keep_alive, limit_concurrency=args.limit_concurrency,
                         backlog=args.backlog, enable_rl_routes=args.enable_rl_routes,
                         disable_additional_properties=args.disable_additional_properties)


def run(config_file: Any, args: Args = Args()) -> int:
    """The command: `config_file` (a ConfigDict or mapping of fields) over
    default_config(); returns the exit status once the server has stopped."""
    logging.set_verbosity(logging.WARNING)  # orbax's and XLA's INFO lines are not for users
    config = apply_overrides(default_config(), config_file)
    validate_config(config)
    import uvicorn

    from jpaged.entrypoints.openai.app import create_app
    from jpaged.entrypoints.openai.guard import DrainingServer, uvicorn_config

    server: uvicorn.Server | None = None

    def stop(*_: Any) -> None:
        if server is not None:
            server.should_exit = True

    options = server_options(args)
    warning = open_address_warning(args.host, options.api_key)
    if warning:
        logging.warning(warning)
    application = create_app(lambda: build_engine(config, args.precompile), config,
                             model_name=args.served_model_name, on_load_failure=stop, options=options)
    server = DrainingServer(uvicorn_config(application, args.host, args.port,
                                           timeout_graceful_shutdown=config.shutdown_grace_seconds,
                                           access_log=args.access_log),
                            application.state.jpaged, config.shutdown_grace_seconds)
    # uvicorn handles SIGINT/SIGTERM while it runs, then re-raises the signal it got
    # into the handlers it found: these stop the server instead of killing the process.
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, stop)
    server.run()
    return 1 if application.state.jpaged.load_error else 0


def main(argv: list[str] | None = None) -> None:
    """`jpaged serve`: parses `argv` (default sys.argv; argv[0] is the program) and exits."""
    config, holders = cli.start(argv, define_flags)

    def command(unused_argv: list[str]) -> None:
        try:
            status = run(config.value, Args(**{name: h.value for name, h in holders.items()}))
        except ConfigError as e:
            cli.exit_usage(str(e))
        sys.exit(status)

    app.run(command, flags_parser=lambda a: cli.parse_flags(a, config))


if __name__ == "__main__":
    main()
