"""N jpaged servers on Ray Serve (`pip install 'jpaged[ray]'`).

    from ray import serve
    from jpaged.entrypoints.ray_serve import deployment
    serve.run(deployment({"model": "smollm2-135m", "max_num_seqs": 16}, num_replicas=2), route_prefix="/")

or from the command line (a Ray cluster: `ray start --head` first, or a local one):

    python -m jpaged.entrypoints.ray_serve --config my_config.py --num_replicas 2 \
        [--config.max_num_seqs=16 ...] [--host 127.0.0.1] [--port 8000] [--num_gpus_per_replica 1]

Each replica is one Ray actor that builds its own engine (create_engine(config):
its own weights, KV pool, prefix cache and scheduler on the devices Ray gives
it: `num_gpus_per_replica` GPUs, or one process on CPU) and serves the same
FastAPI app as `jpaged serve` (jpaged.entrypoints.openai.app.create_app).  Ray
Serve's proxy spreads the HTTP requests over the replicas (power of two choices
on each replica's requests in flight, up to max_ongoing_requests each).  A
replica is ready once its engine is: the app's startup waits for the load, and
a load failure fails the replica (Ray retries it).  Ray's health check fails a
replica whose engine thread died.  Ray drains a replica it stops (no new
requests, graceful_shutdown_timeout_s = the config's shutdown_grace_seconds for
those in flight) before the app shuts its engine down.

Every answer carries `x-jpaged-replica: <Ray's replica id>`.  Each replica
keeps its own Prometheus registry (vLLM's names, openai/metrics.py): GET
/metrics through the proxy is answered by one replica, named by that header;
`replica_metrics(app_name)` collects every replica's text over Ray's handles.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from typing import Any, AsyncIterator, Mapping

REPLICA_HEADER = "x-jpaged-replica"
LOAD_TIMEOUT_SECONDS = 1800.0  # a replica whose engine has not loaded by then fails (Ray retries it)


def _config_dict(config: Any) -> dict[str, Any]:
    """A plain dict of the config fields (what travels to the replicas)."""
    from jpaged.core.config import apply_overrides, default_config, validate_config
    cfg = apply_overrides(default_config(), config)
    validate_config(cfg)
    return cfg.to_dict()


def _replica_id() -> str:
    from ray import serve
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a replica (a unit test of the class)
        return "local"


def _with_replica_header(app: Any, replica_id: str) -> None:
    """Adds `x-jpaged-replica` to every response of `app` (a pure ASGI middleware)."""
    header = (REPLICA_HEADER.encode(), replica_id.encode("latin-1"))

    class ReplicaHeader:
        def __init__(self, inner: Any):
            self.inner = inner

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return await self.inner(scope, receive, send)

            async def send_with_header(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []), header]}
                await send(message)
            await self.inner(scope, receive, send_with_header)

    app.add_middleware(ReplicaHeader)


def _wait_for_load(app: Any, timeout: float) -> None:
    """Makes the app's startup wait for its engine: Ray routes to a replica once its
    startup is over, so none gets a request while /health would still be 503.  A
    failed load fails the startup (and so the replica)."""
    state, inner = app.state.jpaged, app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[None]:
        async with inner(a):
            deadline = time.monotonic() + timeout
            while state.status == "loading" and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if state.status != "ready":
                raise RuntimeError(f"the jpaged engine did not load: {state.status}")
            yield

    app.router.lifespan_context = lifespan


def _server_class() -> type:
    """The deployment class (built on first use: ray is imported only then)."""
    from ray import serve

    @serve.ingress()
    class JpagedServer:
        """One jpaged server: its own engine, behind Ray Serve's proxy."""

        def __init__(self, config: Mapping[str, Any], model_name: str | None = None,
                     options: Any = None, load_timeout: float = LOAD_TIMEOUT_SECONDS):
            from jpaged.core.config import apply_overrides, default_config
            self.config = apply_overrides(default_config(), dict(config))
            self.model_name, self.options, self.load_timeout = model_name, options, load_timeout
            self.replica_id = _replica_id()
            self.state: Any = None

        def __serve_build_asgi_app__(self) -> Any:
            from jpaged.engine.router import create_engine
            from jpaged.entrypoints.openai.app import create_app
            config = self.config
            app = create_app(lambda: create_engine(config), config, model_name=self.model_name,
                             options=self.options)
            self.state = app.state.jpaged
            _with_replica_header(app, self.replica_id)
            _wait_for_load(app, self.load_timeout)
            return app

        def check_health(self) -> None:
            """Ray's periodic health check: a replica whose engine failed or stopped is restarted."""
            state = self.state
            if state is None or state.status == "loading":
                return
            if state.status.startswith("failed") or (state.engine is not None and not state.engine.is_running):
                raise RuntimeError(f"jpaged engine down: {state.status}")

        def metrics(self) -> tuple[str, str]:
            """(replica id, this replica's /metrics text): for replica_metrics."""
            return self.replica_id, self.state.metrics.render().decode() if self.state is not None else ""

    return JpagedServer


def deployment(config: Any = None, *, num_replicas: int = 1, model_name: str | None = None,
               options: Any = None, num_cpus_per_replica: float = 1, num_gpus_per_replica: float = 0,
               ray_actor_options: Mapping[str, Any] | None = None, max_ongoing_requests: int | None = None,
               **deployment_options: Any) -> Any:
    """The bound Ray Serve application of `num_replicas` jpaged servers on `config`
    (a ConfigDict or mapping of fields over default_config(); checked here, before
    any replica starts).  Pass it to `serve.run(app, route_prefix="/")`.

    Each replica asks Ray for num_cpus_per_replica CPUs and num_gpus_per_replica
    GPUs (tensor_parallel_size * data_parallel_size of them for a sharded
    engine); `ray_actor_options` replaces both (e.g. {"resources": {"TPU": 4}}).
    `max_ongoing_requests` (default: what one engine runs and queues,
    max_num_seqs * data_parallel_size + max_queued_requests) caps the requests Ray
    sends one replica; beyond it they wait in Ray's router.  `options`: the
    ServerOptions of every replica (API key, request limits).  Other keywords
    (autoscaling_config, health_check_period_s, ...) go to serve.deployment.
    """
    from ray import serve
    fields = _config_dict(config)
    if max_ongoing_requests is None:
        max_ongoing_requests = fields["max_num_seqs"] * fields["data_parallel_size"] + fields["max_queued_requests"]
    actor = dict(ray_actor_options) if ray_actor_options is not None else {"num_cpus": num_cpus_per_replica}
    if ray_actor_options is None and num_gpus_per_replica:
        actor["num_gpus"] = num_gpus_per_replica
    settings: dict[str, Any] = dict(name="jpaged", ray_actor_options=actor, max_ongoing_requests=max_ongoing_requests,
                                    graceful_shutdown_timeout_s=fields["shutdown_grace_seconds"])
    if "autoscaling_config" not in deployment_options:
        settings["num_replicas"] = num_replicas
    settings.update(deployment_options)
    return serve.deployment(_server_class(), **settings).bind(fields, model_name, options)


def replica_metrics(app_name: str = "default", deployment_name: str = "jpaged", *, timeout: float = 30.0,
                    attempts: int = 64) -> dict[str, str]:
    """{replica id: its /metrics text} of a running application, asked over Ray's
    handles until every running replica has answered (or `attempts` calls)."""
    from ray import serve
    from ray.serve._private.common import ReplicaState
    handle = serve.get_deployment_handle(deployment_name, app_name=app_name)
    status = serve.status().applications[app_name].deployments[deployment_name]
    running = status.replica_states.get(ReplicaState.RUNNING, 0) if hasattr(status, "replica_states") else 1
    out: dict[str, str] = {}
    for _ in range(attempts):
        replica, text = handle.metrics.remote().result(timeout_s=timeout)
        out[replica] = text
        if len(out) >= running:
            break
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m jpaged.entrypoints.ray_serve`: deploys and serves until interrupted."""
    import ray
    from ray import serve

    from jpaged.core.config import ConfigError
    from jpaged.entrypoints import cli
    parser = argparse.ArgumentParser(prog="python -m jpaged.entrypoints.ray_serve", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=cli.CONFIG_DEFAULT, help="a config file whose get_config() returns "
                        "the config, as `jpaged serve --config` (default: the embedded SmolLM2)")
    parser.add_argument("--num_replicas", type=int, default=1)
    parser.add_argument("--num_cpus_per_replica", type=float, default=1)
    parser.add_argument("--num_gpus_per_replica", type=float, default=0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served_model_name", default=None)
    parser.add_argument("--address", default=None, help="the Ray cluster (default: RAY_ADDRESS, else a local one)")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    overrides: dict[str, Any] = {}
    config = _load_config(args.config)
    for item in rest:
        if not item.startswith("--config.") or "=" not in item:
            parser.error(f"unknown argument {item!r} (config fields are --config.field=value)")
        name, value = item[len("--config."):].split("=", 1)
        overrides[name] = _literal(value)
    try:
        from jpaged.core.config import apply_overrides, default_config
        fields = _config_dict(apply_overrides(apply_overrides(default_config(), config), overrides))
        app = deployment(fields, num_replicas=args.num_replicas, model_name=args.served_model_name,
                         options=_options(), num_cpus_per_replica=args.num_cpus_per_replica,
                         num_gpus_per_replica=args.num_gpus_per_replica)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ray.init(address=args.address)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(app, name="jpaged", route_prefix="/")
    print(f"serving {args.num_replicas} jpaged replicas on http://{args.host}:{args.port}", flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM too: shut Serve down, then exit
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()  # Ray drains each replica (graceful_shutdown_timeout_s) before stopping it
    return 0


def _options() -> Any:
    """ServerOptions with the API key of the environment's JPAGED_API_KEY."""
    import os

    from jpaged.entrypoints.openai.state import ServerOptions
    return ServerOptions(api_key=os.environ.get("JPAGED_API_KEY") or None)


def _load_config(path: str) -> Any:
    """A config file's get_config() (ml_collections' convention, as --config)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("jpaged_ray_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def _literal(text: str) -> Any:
    import ast
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return {"true": True, "false": False}.get(text.lower(), text)


if __name__ == "__main__":
    sys.exit(main())
