"""`specbeam serve`: an OpenAI-compatible server on localhost (and LibreTranslate's /translate) for editors, chat
UIs and scripts: exact beam search and speculation behind the API clients already speak, every request in
flight sharing each target pass.

    specbeam serve --model qwen2.5-coder-1.5b                 # then base URL http://127.0.0.1:8080/v1
    specbeam serve --model smollm2 --model ende=models/ende/target --draft none --draft models/ende/draft
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from specbeam_edge.commands.flags import PROVIDERS, parse_size, positive_int

from .models import NO_DRAFT, ModelSpec, Registry, Served, kv_bytes_per_token, resolve

PROG = "specbeam serve"


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, metavar="[ID=]NAME_OR_FOLDER",
                    help="a fetched model's name or a model folder; repeat for more models; ID= names it for "
                         "clients (default: the name, or the folder's name)")
    ap.add_argument("--draft", action="append", default=None, metavar="NAME_OR_FOLDER",
                    help="the draft of the --model in the same position ('none': no draft); default: a fetched "
                         "model's own draft, as specbeam generate uses it")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface; set "
                                                          "--api_key then)")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--api_key", default=os.environ.get("SPECBEAM_API_KEY"),
                    help="a key clients must send (Authorization: Bearer KEY); default: $SPECBEAM_API_KEY, else none")
    ap.add_argument("--max_batch_size", type=positive_int, default=8, help="requests that share each pass")
    ap.add_argument("--max_waiting", type=int, default=32,
                    help="requests that wait for a place; more are answered 429 with Retry-After")
    ap.add_argument("--kv_memory", type=parse_size, default=None,
                    help="KV cache the requests in flight of a model may hold together, e.g. 2GB (each may hold "
                         "(prompt + max_tokens) x beams tokens); a request larger than that alone is refused, others "
                         "wait their turn (default: no bound)")
    ap.add_argument("--max_body", type=parse_size, default=None, help="largest request body (default 8MB)")
    ap.add_argument("--threads", type=positive_int, default=None, help="onnxruntime intra-op threads")
    ap.add_argument("--max_memory", type=parse_size, default=None,
                    help="budget for each target's weights in memory (split layout: other layers stream)")
    ap.add_argument("--provider", choices=("cpu", "cuda"), default="cpu", help="onnxruntime execution provider")
    ap.add_argument("--prefill_chunk", type=positive_int, default=None,
                    help="a prompt's tokens a pass scores (default 256; llama-server's --ubatch-size): fewer lower a "
                         "long prompt's peak memory")
    ap.add_argument("--log_level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    args = ap.parse_args(argv)
    if args.draft and len(args.draft) > len(args.model):
        ap.error(f"{len(args.draft)} --draft for {len(args.model)} --model; give at most one --draft per --model")
    if not 0 < args.port < 65536:
        ap.error(f"--port {args.port} is not a port (1-65535)")
    return args


def specs(args) -> list[ModelSpec]:
    drafts = (args.draft or []) + [None] * len(args.model)
    out = []
    for m, d in zip(args.model, drafts):
        name, _, model = m.partition("=") if "=" in m and not os.path.exists(m) else ("", "", m)
        out.append(ModelSpec(model, d, name))
    names = [s.name for s in out]
    if len(set(names)) < len(names):
        raise SystemExit(f"{PROG}: error: two models are named alike ({', '.join(names)}); name them ID=MODEL")
    return out


def loader(args, batch: dict):
    """spec -> Served: the engine as the tools open it, and its batcher."""
    from specbeam_edge.generate import Engine
    from specbeam_edge.online import Batcher

    def load(spec: ModelSpec) -> Served:
        folder, draft, ahead = resolve(spec)
        print(f"{PROG}: loading {spec.name}{' with the draft ' + os.path.basename(draft) if draft else ''}...",
              file=sys.stderr, flush=True)
        engine = Engine(folder, draft=draft, threads=args.threads, max_memory=args.max_memory,
                        providers=PROVIDERS[args.provider], prefill_chunk=args.prefill_chunk)
        kv = args.kv_memory // kv_bytes_per_token(engine.target) if args.kv_memory else None
        return Served(spec.name, engine, Batcher(engine, max_batch_tokens=kv, **batch), ahead=ahead,
                      created=int(time.time()), kv_tokens=kv)
    return load


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import uvicorn

        from .app import MAX_BODY, Server, build
    except ImportError as e:
        print(f"{PROG}: error: the server needs the serve extra ({e.name} is missing): pip install -e \".[cpu,serve]\"",
              file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"{PROG}: warning: listening on {args.host} without --api_key: anyone who reaches this address can "
              f"use the models", file=sys.stderr, flush=True)
    batch = dict(max_batch_size=args.max_batch_size, max_waiting=args.max_waiting)
    registry = Registry(specs(args), loader(args, batch))
    server = Server(registry, api_key=args.api_key, max_body=args.max_body or MAX_BODY)
    config = uvicorn.Config(build(server), host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.log_level in ("info", "debug"))
    web = uvicorn.Server(config)
    host = f"[{args.host}]" if ":" in args.host else args.host
    registry.on_error = lambda: setattr(web, "should_exit", True)      # a model that cannot load ends the server
    registry.on_ready = lambda: print(f"{PROG}: ready: {', '.join(registry.models)}", file=sys.stderr, flush=True)
    registry.start()
    print(f"{PROG}: listening on http://{host}:{args.port} (OpenAI base URL http://{host}:{args.port}/v1); "
          f"GET /health answers 200 once the models are loaded", file=sys.stderr, flush=True)
    try:
        web.run()
    except KeyboardInterrupt:
        pass
    finally:
        registry.close()
    if registry.error:
        print(f"{PROG}: error: {registry.error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["NO_DRAFT", "main"]
