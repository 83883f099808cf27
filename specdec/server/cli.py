"""`specdec serve MODEL`: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import os

from specdec.engine_args import add_engine_args, engine_kwargs
from specdec.speculate.config import add_spec_args, spec_config_from_args


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model", help="Hugging Face model directory, or a bundled short name (ref-target)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECDEC_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL)")
    p.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body accepted (MiB)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_spec_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)
    return p


def default_model_name(args: argparse.Namespace) -> str:
    """MODEL, or "MODEL as SHAPE twin" for a scaled twin: a twin is always named for what it is."""
    return f"{args.model} as {args.twin} twin" if getattr(args, "twin", None) else args.model


def cmd_serve(args: argparse.Namespace) -> int:
    from specdec.server.app import create_app
    from specdec.server.engine_process import EngineProcess, EngineSpec
    from specdec.parent_watch import exit_with_parent
    from specdec.server.process import serve

    exit_with_parent()  # before the engine builds (minutes): a supervisor killed meanwhile must not leave us behind
    if args.tensor_parallel_size != 1:  # ranks > 0 would need rank 0's requests mirrored to them
        from specdec.errors import ConfigError

        raise ConfigError("serve does not support --tensor-parallel-size yet: use specdec generate under torchrun")
    engine = EngineProcess(EngineSpec(args.model, dict(speculator=spec_config_from_args(args), **engine_kwargs(args))))
    engine.launch()  # built before the port opens: a bad model or flag ends the command with its reason
    app = create_app(engine, args.served_model_name or default_model_name(args), args.api_key,
                     int(args.max_body_mb * (1 << 20)))
    serve(app, args.host, args.port, log_level=args.log_level)
    return 0
