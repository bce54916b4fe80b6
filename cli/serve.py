"""`drelay serve --config platform/serve/<name>.yaml`: an OpenAI-compatible Ray Serve endpoint with
DRelay enabled (logic in `deploy/serve/`; see docs/serving.md)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    from deploy.serve.commands import add_serve_args

    p = sub.add_parser("serve", help="serve an OpenAI-compatible endpoint (Ray Serve)", description=__doc__)
    add_serve_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from deploy.serve.commands import run_serve

    return run_serve(args)
