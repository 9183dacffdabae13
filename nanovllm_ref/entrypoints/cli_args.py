"""Command-line flags of `serve` and `chat` (the engine flags they share with `generate` are __main__'s).

Only argparse here: building the parser must not import the server's stack (FastAPI, uvicorn).
"""
import argparse
import json

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20      # serve's body limit: 8 MiB, about 2M tokens of text, far beyond a context
# CORS (Starlette's CORSMiddleware arguments), vLLM's defaults: a page on any origin may call the server with any
# method and header, without credentials (cookies, HTTP auth); Authorization: Bearer is a header, not a credential.
DEFAULT_CORS = {"allow_origins": ["*"], "allow_methods": ["*"], "allow_headers": ["*"], "allow_credentials": False}


def add_more_engine_flags(p) -> None:
    """Engine arguments a long-running server sets more often than `generate` does; None = engine default."""
    p.add_argument("--max-num-seqs", type=int, default=None, help="most sequences in one batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one prefill step")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, help="fraction of GPU memory to use")
    p.add_argument("--load-format", default=None, choices=["auto", "dummy"],
                   help="dummy: random weights (benchmarks of a model shape)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="share the KV blocks of equal prompt prefixes")
    p.add_argument("--seed", type=int, default=None, help="the engine's seed")
    # Test hook (serving_engine.py): build the engine with module:callable instead of LLMEngine.
    p.add_argument("--engine-factory", default=None, help=argparse.SUPPRESS)
    p.add_argument("--engine-factory-kwargs", default=None, help=argparse.SUPPRESS)


def more_engine_args(args) -> dict:
    names = ("max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "load_format",
             "enable_prefix_caching", "seed", "generation_config", "override_generation_config")   # the last two: serve's
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _json_dict(flag: str):
    """An argparse type: a JSON object, as vLLM's --override-generation-config takes, e.g. '{"temperature": 0.5}'."""
    def parse(text: str) -> dict:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON object such as '{{\"temperature\": 0.5}}', "
                                             f"got {text!r}")
        return value
    return parse


def _int_in(name: str, low: int, high: int | None = None):
    """An argparse type: an int in [low, high] (argparse's error then names the flag and says the range)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an int, got {text!r}") from None
        if value < low or (high is not None and value > high):
            allowed = f"{low}..{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"{name} must be in {allowed}, got {value}")
        return value
    return parse


def _json_list(flag: str):
    """An argparse type: a JSON list of str, as vLLM's --allowed-origins takes (its type is json.loads), e.g.
    '["https://app.example"]'; argparse's error names the flag and says what it wants."""
    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON list of str such as '[\"*\"]' or "
                                             f"'[\"http://localhost:3000\"]', got {text!r}")
        return value
    return parse


def add_serve_flags(p) -> None:
    add_more_engine_flags(p)
    # vLLM's flags: the sampling defaults a request that leaves a field out gets (nanovllm_ref/sampling_defaults.py)
    p.add_argument("--generation-config", default="auto",
                   help="where a request's omitted sampling fields get their defaults: auto (the model folder's "
                        "generation_config.json), vllm (none) or a folder holding generation_config.json")
    p.add_argument("--override-generation-config", type=_json_dict("--override-generation-config"), default=None,
                   help='sampling defaults laid over those, a JSON object of temperature, top_k, top_p, min_p, '
                        'repetition_penalty, max_new_tokens (null drops one), e.g. \'{"temperature": 0.5}\'')
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=_int_in("a TCP port", 1, 65535), default=8000, help="TCP port (1..65535)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: the --model value)")
    p.add_argument("--engine-core", choices=["process", "thread"], default=None,
                   help="where the engine core (scheduler, model) runs: its own process, fed over ZMQ, or a thread "
                        "of the server (default: process on CUDA, thread on a CPU)")
    p.add_argument("--max-queued-requests", type=int, default=1024,
                   help="most requests held at once (waiting or running); one more is answered 503")
    p.add_argument("--max-request-bytes", type=_int_in("the body size", 1), default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body accepted; a larger one is answered 413")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    p.add_argument("--access-log", action="store_true", help="log one line per HTTP request")
    # CORS, vLLM's flags: which web pages (origins) a browser lets call this server, and how.
    p.add_argument("--allowed-origins", type=_json_list("--allowed-origins"),
                   default=list(DEFAULT_CORS["allow_origins"]),
                   help='origins whose pages may call the server, a JSON list (["*"]: any)')
    p.add_argument("--allowed-methods", type=_json_list("--allowed-methods"),
                   default=list(DEFAULT_CORS["allow_methods"]),
                   help="HTTP methods such a page may use, a JSON list")
    p.add_argument("--allowed-headers", type=_json_list("--allowed-headers"),
                   default=list(DEFAULT_CORS["allow_headers"]),
                   help="request headers such a page may send, a JSON list")
    p.add_argument("--allow-credentials", action="store_true",
                   help="let such a page send cookies and HTTP authentication")


def add_chat_flags(p) -> None:
    add_more_engine_flags(p)
    p.add_argument("--system", default=None, help="a system message that opens the conversation")
    p.add_argument("--max-tokens", type=int, default=256, help="most new tokens per answer")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
