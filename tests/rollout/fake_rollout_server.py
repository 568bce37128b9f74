"""Run a FakeEngine behind the embedded HTTP server in its own process (so tests can SIGKILL it).

Usage: python fake_rollout_server.py --port-file F [--step-delay-s S] [--fail-path P ...] [--no-routed-experts]
       [--checkpoint CKPT --weight-version V] [--port N]
The bound port is written to F (atomically) once the server accepts connections.
"""

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fake_rollout_engine import FakeEngine  # noqa: E402

from jaxrl_fp8.rollout.http_server import ServerConfig, serve_forever  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--step-delay-s", type=float, default=0.0)
    ap.add_argument("--fail-path", action="append", default=[])
    ap.add_argument("--no-routed-experts", action="store_true")
    ap.add_argument("--checkpoint")
    ap.add_argument("--weight-version", default="v0")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    engine = FakeEngine(step_delay_s=args.step_delay_s, fail_paths=args.fail_path)
    if args.checkpoint:
        engine.update_weights_from_disk(args.checkpoint, args.weight_version)
    else:
        engine.set_weight_version(args.weight_version)
    config = ServerConfig(enable_return_routed_experts=not args.no_routed_experts)

    def ready(server):
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(server.port))
        os.replace(tmp, args.port_file)

    serve_forever(engine, "127.0.0.1", args.port, config, ready=ready)


if __name__ == "__main__":
    main()
