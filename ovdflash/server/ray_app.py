"""Replicas of the OpenAI-compatible server on Ray Serve, behind one HTTP endpoint.

Contract:
- `build_ray_app(model_dir=None, replicas=2, num_cpus_per_replica=None, **options)` -> a
  `ray.serve.Application` to pass to `serve.run` (for people who compose their own). Every replica
  loads and warms up its own pipeline with `wiring.load_pipeline` and serves the same FastAPI
  app as `ovdflash serve` (`wiring.build_server_app`), so requests, responses, errors and
  limits are the same. `options` are `serve`'s (ServeOptions' fields). A replica reserves
  `ray_actor_options={"num_cpus": n}` and compiles with `INFERENCE_NUM_THREADS` = n (at least 1;
  an explicit `-c INFERENCE_NUM_THREADS=...` wins). Default n: this host's CPUs / replicas.
- Every HTTP response carries `x-ovdflash-replica: <replica tag>` (serve.get_replica_context()).
- `/health` reports every replica. How: a second, CPU-less deployment, `ReplicaBoard` (one
  replica), to which each model replica reports its state every `report_interval_s` seconds; the
  replica that answers /health reads the board. Why a board and not a fan-out through a handle: a
  DeploymentHandle routes each call to a replica of its choosing, so no set of handle calls is
  sure to reach every replica, and a dead replica answers nothing, while a board still lists it
  (as "silent", until `forget_after_s`). The answer: 200 with `status` "ok" when all `replicas`
  reported healthy within `silent_after_s`, "degraded" when fewer did; 503 only when the
  answering replica's own engine is down (the old single-server meaning). Each entry names the
  replica's tag, Ray actor name, node, pid, OpenVINO thread count and age of its last report.
- `/metrics` is the Prometheus exposition of every replica that reported within
  `silent_after_s`, each series labelled `replica="<tag>"` (a per-replica route cannot work:
  Ray's proxy picks the replica, so a scrape through it reaches one at random). The answering
  replica's series are live; the others' are from their last report (one `report_interval_s`
  old, at most `silent_after_s`). Ray's own serve_* metrics (requests, latencies, per replica)
  are on each node's Ray metrics export port, untouched.
- Ray Serve restarts a replica that dies (or whose engine thread stops: `check_health`); its
  router stops sending to a replica whose actor died, so requests keep being served.
- `serve_on_ray(...)` is `ovdflash serve --replicas N`: it connects to `ray_address` or starts a
  local Ray instance bound to loopback (`start_local_ray`), runs the app on `host:port` through
  Ray Serve's proxy, and on SIGTERM/SIGINT deletes the app (replicas get `shutdown_timeout` s to
  finish open requests) and stops the local instance, exiting normally.
Ray is imported only inside these functions: importing this module needs no Ray.
"""
from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import math
import os
import signal
import threading
import time
from pathlib import Path

from ..decode.scheduler import DEFAULT_PREFILL_BATCH_TOKENS

logger = logging.getLogger("ovdflash.server.ray")

REPLICA_HEADER = "x-ovdflash-replica"
APP_NAME = "ovdflash"
DEPLOYMENT_NAME = "OpenAIReplica"
BOARD_NAME = "ReplicaBoard"
THREADS_PROPERTY = "INFERENCE_NUM_THREADS"
# Ray reads this at import: with it off, a local instance takes the loopback address as its node IP
_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
MISSING_RAY = "--replicas needs Ray Serve: pip install 'ovdflash[ray]'"


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """What each replica needs to build `ovdflash serve`'s app (the CLI options of the same names)."""
    served_model_names: tuple[str, ...] = ()
    block_size: int | str | None = None
    no_draft: bool = False
    prompt_lookup: bool = True
    device: str = "CPU"
    cache_dir: str | None = None
    config: tuple[str, ...] = ()
    target_runner: str | None = None
    precision: str | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    prefill_batch_tokens: int | None = DEFAULT_PREFILL_BATCH_TOKENS
    kv_cache_memory_bytes: str | int | None = None
    prefix_cache_memory_bytes: str | int | None = None
    enable_prefix_caching: bool = True
    wide_target: bool | None = None
    confidence_threshold: float | None = None
    max_queue: int = 128
    max_model_len: int | None = None
    api_key: str | None = None
    max_request_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class _ReplicaSettings:
    model_dir: str | None
    options: ServeOptions
    num_cpus: float
    replicas: int
    report_interval_s: float
    silent_after_s: float


def default_num_cpus(replicas: int) -> int:
    """This host's CPUs shared out among `replicas` (at least one each)."""
    return max(1, (os.cpu_count() or 1) // replicas)


def thread_count(num_cpus: float) -> int:
    """OpenVINO threads for a replica holding `num_cpus` Ray CPUs (a fraction still gets one)."""
    return max(1, math.floor(num_cpus))


def with_thread_count(config: tuple[str, ...], num_cpus: float) -> tuple[str, ...]:
    """`config` (KEY=VALUE items) plus INFERENCE_NUM_THREADS for `num_cpus`, unless it sets one itself."""
    if any(item.partition("=")[0].strip() == THREADS_PROPERTY for item in config):
        return tuple(config)
    return (*config, f"{THREADS_PROPERTY}={thread_count(num_cpus)}")


# -- the board: every replica's last report ------------------------------------------------------
class ReplicaBoard:
    """Holds each model replica's last report; the /health and /metrics of any replica read it."""

    def __init__(self, forget_after_s: float = 30.0):
        self.forget_after_s = forget_after_s
        self._reports: dict[str, tuple[float, dict]] = {}

    def report(self, tag: str, state: dict) -> None:
        self._reports[tag] = (time.monotonic(), state)  # the board's clock: replicas' clocks may differ

    def leave(self, tag: str) -> None:
        self._reports.pop(tag, None)

    def view(self) -> list[dict]:
        """Every report not older than forget_after_s, with its age in seconds, oldest replica first."""
        now = time.monotonic()
        self._reports = {t: r for t, r in self._reports.items() if now - r[0] <= self.forget_after_s}
        return [{**state, "age_s": round(now - seen, 3)} for seen, state in
                sorted(self._reports.values(), key=lambda r: r[1].get("started", 0.0))]


# -- the replica: ovdflash serve's app plus the header, /health and /metrics -----------------------
class ReplicaHeaderMiddleware:
    """ASGI middleware: every HTTP response names the replica that served it."""

    def __init__(self, app, value: str):
        self.app = app
        self.header = (REPLICA_HEADER.encode(), value.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


def merge_expositions(texts: dict[str, str]) -> bytes:
    """One Prometheus exposition of several (replica tag -> text), each series labelled replica=tag."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    for tag, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                             family.unit))
            for sample in family.samples:
                merged.add_sample(sample.name, {**sample.labels, "replica": tag}, sample.value, sample.timestamp,
                                  sample.exemplar)

    class _Merged:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)


class OpenAIReplica:
    """One replica: its own pipeline and engine, serving `ovdflash serve`'s app (see the module contract)."""

    def __init__(self, board, settings: _ReplicaSettings):
        from ray import serve

        context = serve.get_replica_context()
        self.board = board
        self.settings = settings
        self.tag = context.replica_tag
        self.actor_name = context.replica_id.to_full_id_str()
        self.started = time.time()
        self.engine = None
        self.threads = None
        self._reporter = None

    async def __serve_build_asgi_app__(self):
        """Load the pipeline (on this replica's loop: nothing else runs here before the app exists)."""
        from .wiring import build_server_app, load_pipeline

        s, o = self.settings, self.settings.options
        pipe = load_pipeline(s.model_dir, o.device, o.no_draft, o.cache_dir, o.target_runner, o.prompt_lookup,
                             o.precision, with_thread_count(o.config, s.num_cpus), o.block_size,
                             o.enable_prefix_caching, o.wide_target, o.confidence_threshold)
        self.threads = int(pipe.target.compiled.get_property(THREADS_PROPERTY))
        names = list(o.served_model_names) or [Path(pipe.model_dir).name]
        app = build_server_app(pipe, names, block_size=o.block_size, draft=False if o.no_draft else None,
                               max_num_seqs=o.max_num_seqs, max_queue=o.max_queue, max_model_len=o.max_model_len,
                               api_key=o.api_key, max_request_bytes=o.max_request_bytes,
                               kv_cache_memory_bytes=o.kv_cache_memory_bytes,
                               max_num_batched_tokens=o.max_num_batched_tokens,
                               prefill_batch_tokens=o.prefill_batch_tokens,
                               prefix_cache_memory_bytes=o.prefix_cache_memory_bytes)
        self.engine = app.state.engine
        _replace_get_route(app, "/health", self.health)
        _replace_get_route(app, "/metrics", self.metrics)
        app.add_middleware(ReplicaHeaderMiddleware, value=self.tag)
        await self._board_view()  # the handle's first call is slow: make it before this replica serves
        self._reporter = asyncio.get_running_loop().create_task(self._report_forever())
        logger.info("replica %s: %s, %d OpenVINO threads", self.tag, pipe.model_dir, self.threads)
        return app

    @property
    def healthy(self) -> bool:
        return self.engine is not None and self.engine.healthy and self.engine.accepting

    def state(self) -> dict:
        import ray
        from prometheus_client import generate_latest

        return {"replica": self.tag, "actor_name": self.actor_name, "node": ray.util.get_node_ip_address(),
                "pid": os.getpid(), "healthy": self.healthy, "inference_threads": self.threads,
                "started": self.started, "metrics": generate_latest(self.engine.metrics.registry).decode()}

    async def _report_forever(self) -> None:
        interval = self.settings.report_interval_s
        while True:
            try:
                await asyncio.wait_for(self.board.report.remote(self.tag, self.state()), timeout=10 * interval)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the board restarts like any replica: report again next time
                logger.warning("replica %s: reporting to the board failed: %s", self.tag, exc)
            await asyncio.sleep(interval)

    async def _board_view(self) -> list[dict] | None:
        try:
            return await asyncio.wait_for(self.board.view.remote(), timeout=5.0)
        except Exception as exc:
            logger.warning("replica %s: the board did not answer: %s", self.tag, exc)
            return None

    async def _replicas(self) -> tuple[list[dict], bool]:
        """Every replica's state with its age (this one's live, the others' from the board), and
        whether the board answered."""
        view = await self._board_view()
        own = {**self.state(), "age_s": 0.0}
        return [own, *(r for r in view or [] if r["replica"] != self.tag)], view is not None

    async def health(self):
        from fastapi.responses import JSONResponse

        replicas, board_answered = await self._replicas()
        limit = self.settings.silent_after_s
        listed = [{k: v for k, v in r.items() if k not in ("metrics", "healthy")}
                  | {"status": "silent" if r["age_s"] > limit else "ok" if r["healthy"] else "unhealthy"}
                  for r in replicas]
        num_ok = sum(r["status"] == "ok" for r in listed)
        body = {"status": "ok" if num_ok >= self.settings.replicas else "degraded",
                "replicas_expected": self.settings.replicas, "replicas_ok": num_ok, "answered_by": self.tag,
                "board": "ok" if board_answered else "unavailable", "silent_after_s": limit, "replicas": listed}
        if not self.healthy:
            body["status"] = "unavailable"
            return JSONResponse(body, status_code=503)
        return body

    async def metrics(self):
        from fastapi.responses import Response
        from prometheus_client import CONTENT_TYPE_LATEST

        replicas, _ = await self._replicas()
        texts = {r["replica"]: r["metrics"] for r in replicas if r["age_s"] <= self.settings.silent_after_s}
        return Response(merge_expositions(texts), media_type=CONTENT_TYPE_LATEST)

    def check_health(self) -> None:
        """Ray Serve's periodic probe: a stopped engine makes Ray replace this replica."""
        if self.engine is not None and not self.engine.healthy:
            raise RuntimeError(f"replica {self.tag}: the engine has stopped")

    async def __del__(self):  # Ray Serve awaits this when it stops the replica
        if self._reporter is not None:
            self._reporter.cancel()
        try:  # a replica stopped on purpose leaves the board instead of going silent
            await asyncio.wait_for(self.board.leave.remote(self.tag), timeout=2.0)
        except Exception:
            pass


def _replace_get_route(app, path: str, endpoint) -> None:
    """Serve GET `path` with `endpoint` instead of the route the app was built with."""
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != path]
    app.add_api_route(path, endpoint, methods=["GET"])


# -- building and running the application ------------------------------------------------------------
def import_serve():
    """`ray.serve`, or an ImportError whose message is the one line that says how to get it."""
    try:
        from ray import serve
    except ImportError as exc:
        raise ImportError(f"{MISSING_RAY} ({exc})") from exc
    return serve


def replica_settings(model_dir: str | Path | None = None, replicas: int = 2, num_cpus_per_replica: float | None = None,
                     report_interval_s: float = 1.0, silent_after_s: float = 5.0, **options) -> _ReplicaSettings:
    """What every replica gets, checked here (without Ray) so that bad options fail before any replica starts."""
    from ..decode.block_policy import ConfidenceCut
    from ..decode.scheduler import check_token_budget
    from ..manifest import load_manifest
    from ..options import parse_config_options
    from .wiring import parse_bytes

    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    num_cpus = default_num_cpus(replicas) if num_cpus_per_replica is None else num_cpus_per_replica
    if not num_cpus > 0:
        raise ValueError(f"--num-cpus-per-replica must be > 0, got {num_cpus}")
    if report_interval_s <= 0:
        raise ValueError(f"report_interval_s must be > 0, got {report_interval_s}")
    if silent_after_s <= report_interval_s:
        raise ValueError(f"silent_after_s ({silent_after_s}) must exceed report_interval_s ({report_interval_s})")
    unknown = set(options) - {f.name for f in dataclasses.fields(ServeOptions)}
    if unknown:
        raise TypeError(f"unknown server options: {', '.join(sorted(unknown))}")
    for key in ("config", "served_model_names"):
        options[key] = tuple(options.get(key, ()))
    parse_config_options(options["config"])
    if options.get("cache_dir") is not None:  # replicas do not run in this process's directory
        options["cache_dir"] = str(Path(options["cache_dir"]).resolve())
    serve_options = ServeOptions(**options)
    seqs = serve_options.max_num_seqs
    if seqs is not None and (isinstance(seqs, bool) or not isinstance(seqs, int) or seqs < 1):
        raise ValueError(f"--max-num-seqs must be an integer >= 1, got {seqs!r}")
    if serve_options.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {serve_options.max_queue}")
    if serve_options.kv_cache_memory_bytes is not None:
        parse_bytes(serve_options.kv_cache_memory_bytes)
    if serve_options.prefix_cache_memory_bytes is not None:
        parse_bytes(serve_options.prefix_cache_memory_bytes, "--prefix-cache-memory-bytes", allow_zero=True)
    check_token_budget(serve_options.max_num_batched_tokens, "--max-num-batched-tokens")
    check_token_budget(serve_options.prefill_batch_tokens, "--prefill-batch-tokens")
    if serve_options.confidence_threshold is not None:
        ConfidenceCut(serve_options.confidence_threshold)
    if model_dir is not None:
        model_dir = Path(model_dir).resolve()
        load_manifest(model_dir)
    return _ReplicaSettings(str(model_dir) if model_dir is not None else None, serve_options, float(num_cpus),
                            replicas, report_interval_s, silent_after_s)


def build_ray_app(model_dir: str | Path | None = None, replicas: int = 2, num_cpus_per_replica: float | None = None,
                  *, max_ongoing_requests: int | None = None, report_interval_s: float = 1.0,
                  silent_after_s: float = 5.0, forget_after_s: float = 30.0, shutdown_timeout: float = 5.0,
                  health_check_period_s: float = 10.0, **options):
    """The Ray Serve application of `replicas` ovdflash servers (see the module contract).

    `options`: ServeOptions' fields (`ovdflash serve`'s options). `max_ongoing_requests` (Ray's
    per-replica limit; default max_num_seqs + 1, so a request is ready when a sequence ends) and
    `max_queue` (also Ray's max_queued_requests: beyond it Ray's proxy answers 503) decide where
    requests wait. `health_check_period_s`: how often Ray probes each replica (a dead one is
    replaced after the probe that finds it). `shutdown_timeout`: how long a stopping replica's open
    requests may run on. `report_interval_s`, `silent_after_s`, `forget_after_s`: the board's
    (see the contract).
    """
    settings = replica_settings(model_dir, replicas, num_cpus_per_replica, report_interval_s, silent_after_s,
                                **options)
    return _deployments(settings, max_ongoing_requests, forget_after_s, shutdown_timeout, health_check_period_s)


def _deployments(settings: _ReplicaSettings, max_ongoing_requests, forget_after_s, shutdown_timeout,
                 health_check_period_s):
    from .wiring import DEFAULT_MAX_NUM_SEQS

    serve = import_serve()
    seqs = settings.options.max_num_seqs or DEFAULT_MAX_NUM_SEQS
    board = serve.deployment(ReplicaBoard, name=BOARD_NAME, num_replicas=1, ray_actor_options={"num_cpus": 0})
    replica = serve.deployment(
        serve.ingress()(OpenAIReplica), name=DEPLOYMENT_NAME, num_replicas=settings.replicas,
        ray_actor_options={"num_cpus": settings.num_cpus}, max_ongoing_requests=max_ongoing_requests or seqs + 1,
        max_queued_requests=max(1, settings.options.max_queue), graceful_shutdown_timeout_s=shutdown_timeout,
        health_check_period_s=health_check_period_s)
    return replica.bind(board.bind(forget_after_s), settings)


def start_local_ray(num_cpus: int | None = None, object_store_memory: int | None = None, log_to_driver: bool = False,
                    **init_options) -> None:
    """Start a Ray instance on this machine whose every port is bound to loopback, with no dashboard.

    Ray must not have been imported before (it decides the node address at import)."""
    os.environ[_LOOPBACK_ENV] = "0"
    import_serve()
    import ray

    ray.init(num_cpus=num_cpus, object_store_memory=object_store_memory, include_dashboard=False,
             log_to_driver=log_to_driver, **init_options)
    node = ray.util.get_node_ip_address()
    if not ipaddress.ip_address(node).is_loopback:
        ray.shutdown()
        raise RuntimeError(f"the local Ray instance took the address {node}, not loopback: Ray was imported before "
                           "start_local_ray, so it could not be told to stay on this machine")


def run_app(app, host: str, port: int, log_level: str = "info"):
    """Run `app` on Ray Serve's proxy at host:port; returns once every replica answers."""
    serve = import_serve()
    serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": log_level.upper()})
    return serve.run(app, name=APP_NAME, route_prefix="/")


def serve_on_ray(model_dir, replicas: int, num_cpus_per_replica: float | None, ray_address: str | None, host: str,
                 port: int, shutdown_timeout: float = 5.0, log_level: str = "info", echo=print, **options) -> None:
    """`ovdflash serve --replicas N`: serve until SIGTERM or SIGINT (see the module contract)."""
    settings = replica_settings(model_dir, replicas, num_cpus_per_replica, **options)
    if ray_address is None:
        start_local_ray(log_to_driver=True)
    else:
        import_serve()
        import ray

        ray.init(address=ray_address)
    import ray

    serve = import_serve()
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        run_app(_deployments(settings, None, 30.0, shutdown_timeout, 10.0), host, port, log_level)
        echo(f"serving {replicas} replicas ({settings.num_cpus:g} CPUs, {thread_count(settings.num_cpus)} OpenVINO "
             f"threads each) on http://{host}:{port}/v1 through Ray Serve "
             f"({'cluster ' + ray_address if ray_address else 'local instance on loopback'})")
        while not stop.wait(1.0):
            pass
        echo("stopping: each replica's open requests may run on for --shutdown-timeout seconds")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        try:
            serve.delete(APP_NAME)
            if ray_address is None:
                serve.shutdown()
        finally:
            ray.shutdown()
