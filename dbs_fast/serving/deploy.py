"""The same service on Ray Serve: N replicas, each with its own engine (model, batcher, metrics).

Ray Serve's proxy spreads requests over the replicas; inside a replica the FastAPI app of
`dbs_fast.serving.service` runs unchanged (continuous batching, streaming, 400/429). On a laptop:

    dbs-fast serve --ray-replicas 2                 # starts a local Ray, serves on --port

On a cluster (`ray start --head` on one node, `ray start --address HEAD:6379` on the others):

    dbs-fast serve --ray-replicas 8 --ray-address auto
    serve run dbs_fast.serving.deploy:build replicas=8 model=/shared/models/smollm2   # Ray's own CLI

Each replica reserves `--ray-cpus` CPUs (default: its --threads, else 1) so Ray places them
where cores are free, and with `--provider cuda` `--ray-gpus` GPUs (default 1; a fraction shares
one): Ray shows an actor only the GPUs it reserved (CUDA_VISIBLE_DEVICES), so a CUDA replica that
reserved none would see none and run on the CPU. A model directory must exist on every node (or
use `default`, which each node exports on first use).
"""
from __future__ import annotations

from dataclasses import asdict, fields
from typing import get_args

from ..errors import DBSError
from .service import ServiceOptions, create_app


def application(opts: ServiceOptions, replicas: int = 1, cpus: float | None = None, gpus: float | None = None):
    """The bound Ray Serve application (pass it to `serve.run`)."""
    try:
        from ray import serve
    except ImportError as e:
        raise DBSError(f"Ray Serve is not installed: pip install 'dbs-fast[ray]' (missing: {e.name})") from None
    if not isinstance(replicas, int) or replicas < 1:
        raise DBSError(f"`replicas` (dbs-fast serve --ray-replicas) must be an integer >= 1, got {replicas!r}")

    @serve.ingress()
    class DBSFast:
        def __init__(self, options: dict):
            self.options = ServiceOptions(**options)

        def __serve_build_asgi_app__(self):
            return create_app(self.options)

    cpus = cpus if cpus is not None else float(opts.threads or 1)
    gpus = gpus if gpus is not None else (1.0 if opts.provider == "cuda" else 0.0)
    if gpus < 0 or (gpus > 0 and opts.provider != "cuda"):
        raise DBSError(f"`gpus` (dbs-fast serve --ray-gpus) must be >= 0, and > 0 only with the CUDA provider "
                       f"(got {gpus!r}, provider {opts.provider!r})")
    actor = {"num_cpus": cpus} | ({"num_gpus": gpus} if gpus else {})
    return serve.deployment(DBSFast, name="dbs-fast", num_replicas=replicas,
                            ray_actor_options=actor).bind(asdict(opts))


def build(args: dict):
    """Application builder for Ray's CLI: `serve run dbs_fast.serving.deploy:build replicas=4 model=DIR`."""
    names = {f.name: _parse(f.type) for f in fields(ServiceOptions)}     # option -> str parser, from its type
    args = dict(args)
    replicas = int(args.pop("replicas", 1))
    cpus = float(args.pop("cpus")) if "cpus" in args else None
    gpus = float(args.pop("gpus")) if "gpus" in args else None
    unknown = set(args) - set(names)
    if unknown:
        raise DBSError(f"unknown option(s) {sorted(unknown)}; known: replicas, cpus, gpus, {', '.join(names)}")
    return application(ServiceOptions(**{k: names[k](v) for k, v in args.items()}), replicas, cpus, gpus)


def _parse(t):
    """A ServiceOptions field's type as a parser of its command-line string (Optional[int] -> int)."""
    inner = [a for a in get_args(t) if a is not type(None)]
    return inner[0] if inner else t


def run(opts: ServiceOptions, replicas: int, host: str, port: int, address: str | None = None,
        cpus: float | None = None, gpus: float | None = None) -> None:
    """Start (or join, with `address`) Ray, deploy the replicas, serve until interrupted."""
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise DBSError(f"Ray Serve is not installed: pip install 'dbs-fast[ray]' (missing: {e.name})") from None
    app = application(opts, replicas, cpus, gpus)
    ray.init(address=address, ignore_reinit_error=True)
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name="dbs-fast", route_prefix="/", blocking=True)
