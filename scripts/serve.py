"""L9: serve a Qwen3 model over OpenAI's HTTP API, on L8's engine (chunked prefill, prefix sharing,
preemption, CUDA graphs), with FastAPI and uvicorn.

    python scripts/serve.py                      # the embedded tiny model on http://127.0.0.1:8000/v1
    python scripts/serve.py --model DIR --port 0 # a checkpoint directory, on a free port
    python scripts/serve.py --tp 2               # L10: the model split across two ranks (gloo on CPU)
    python scripts/serve.py --speculative ngram  # L11: drafts guessed by prompt lookup, checked each step
    python scripts/serve.py --kv-dtype int8      # L12: K and V stored as int8 with a scale per token and head
    # L13: any request may ask for JSON (response_format) or a regex or choices (structured_outputs)
    python scripts/serve.py --batch-invariant    # L14: each request's logits bitwise the same whatever else runs
    python scripts/serve.py --kv-role kv_producer --port 8100  # L15: a prefill server (P) and a decode server (D),
    python scripts/serve.py --kv-role kv_consumer --port 8200  # joined by scripts/l15_proxy.py
    python scripts/serve.py --weights q4_1       # L16: the matrices as 4-bit GGUF blocks, quantized at load (CPU, fp32)
    python scripts/serve.py --model smollm2 --weights q4_1  # L16: SmolLM2's shipped Q4_1 file, its blocks as they are

    curl -N http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "tiny-qwen3-v3", "prompt": "The capital of France is", "max_tokens": 8, "stream": true}'

A request with `response_format` {"type": "json_schema", ...} gets output that parses and validates.
--weights q8_0 or q4_1 serves L16's engine on weight blocks: on the CPU, fp32 activations, one rank; every other
option works as without it (a request's tokens are those of the fp32 model the blocks dequantize to).
Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics
(Prometheus). Once it answers it prints `serving MODEL at URL`. SIGINT or SIGTERM: new requests are
refused, open requests get --shutdown-timeout seconds to finish (then a 503), and it exits 0.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import signal
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import uvicorn  # noqa: E402

from lessons.l3_block_tensor.backends import BACKENDS  # noqa: E402
from lessons.l4_continuous.engine import DEFAULT_MAX_RUNNING  # noqa: E402
from lessons.l8_chunked_prefill.scheduler import DEFAULT_MAX_BATCHED_TOKENS  # noqa: E402
from lessons.l9_server.app import MAX_BODY_BYTES, ServedModel, create_app  # noqa: E402
from lessons.l9_server.chat import ChatTemplate  # noqa: E402
from lessons.l9_server.detokenizer import TokenBytes  # noqa: E402
from lessons.l9_server.engine_loop import EngineLoop  # noqa: E402
from lessons.l9_server.metrics import ServerMetrics  # noqa: E402
from lessons.l10_tensor_parallel import L10Engine  # noqa: E402
from lessons.l10_tensor_parallel.group import DEFAULT_TIMEOUT_S  # noqa: E402
from lessons.l10_tensor_parallel.launch import follow_if_torchrun, start  # noqa: E402
from lessons.l10_tensor_parallel.layout import check_tp  # noqa: E402
from lessons.l10_tensor_parallel.model import TpQwen3ForCausalLM  # noqa: E402
from lessons.l11_speculative.draft_model import DraftModelDrafter  # noqa: E402
from lessons.l11_speculative.engine import DEFAULT_NUM_SPECULATIVE_TOKENS  # noqa: E402
from lessons.l11_speculative.ngram import NgramDrafter  # noqa: E402
from lessons.l12_kv_quant.backends import int8_backend  # noqa: E402
from lessons.l12_kv_quant.runner import KV_DTYPES  # noqa: E402
from lessons.l13_structured import L13TpEngine  # noqa: E402
from lessons.l13_structured.server import StructuredOutputs  # noqa: E402
from lessons.l14_batch_invariant import L14Engine  # noqa: E402
from lessons.l15_disaggregated import L15Engine  # noqa: E402
from lessons.l15_disaggregated.connector import DEFAULT_LEASE_S, POLICIES  # noqa: E402
from lessons.l15_disaggregated.engine import KV_ROLES  # noqa: E402
from lessons.l15_disaggregated.server import KvEngineLoop, create_kv_app  # noqa: E402
from lessons.l16_weight_quant import L16Engine  # noqa: E402
from lessons.l16_weight_quant.weights import QUANTIZED, WEIGHTS, check_weights, gguf_model, quantized_model  # noqa: E402
from shared.checkpoint import tensor_shapes  # noqa: E402
from shared.cli import HUB_ID, OneLineParser, resolve_device, resolve_dtype, resolve_model_dir  # noqa: E402
from shared.config import Qwen3Config  # noqa: E402
from shared.errors import CourseError, RunFailure  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.named_models import NAMED, gguf_path  # noqa: E402
from shared.pool_live import LivePool, add_routes  # noqa: E402
from shared.pool_trace import PoolRecorder, Tee  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402


# Under load a server's queue is the bigger delay: with L8's budget of 64, 32 clients' prompts trickle in
# and their time to first token grows with the queue (docs/l9_server.md, measured). 512 admits a burst in
# a few steps and still keeps a CPU step short.
SERVER_MAX_BATCHED_TOKENS = 512


def parser() -> OneLineParser:
    p = OneLineParser(prog="serve.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF-format Qwen3 checkpoint directory, or a hub id (default: the embedded tiny model)")
    p.add_argument("--served-model-name", help="the name clients send as \"model\" (default: the directory's name)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (default: 8000)")
    p.add_argument("--device", default="auto", help="cpu | cuda | auto (cuda when available)")
    p.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    p.add_argument("--num-blocks", type=int, help="KV pool size in blocks (default: 4096 tokens' worth)")
    p.add_argument("--max-batched-tokens", type=int, default=SERVER_MAX_BATCHED_TOKENS,
                   help=f"token budget of one engine step (default: {SERVER_MAX_BATCHED_TOKENS}; L8's smoke uses "
                        f"{DEFAULT_MAX_BATCHED_TOKENS})")
    p.add_argument("--max-slice-tokens", type=int, help="most prompt tokens one request computes per step")
    p.add_argument("--max-long-prefills", type=int, help="most long prompts part-way through at once; shorter ones "
                   "pass the rest (default: no limit; needs --long-prefill-threshold, as in L8)")
    p.add_argument("--long-prefill-threshold", type=int, help="a prompt with more tokens than this still to compute "
                   "is long; no slice is longer")
    p.add_argument("--max-running", type=int, default=DEFAULT_MAX_RUNNING, help="most requests in one step")
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="attention kernels (as in L3)")
    p.add_argument("--graphs", default="on", choices=("on", "off"), help="CUDA graphs for decode steps (as in L7)")
    p.add_argument("--tp", type=int, default=1,
                   help="ranks the model is split across (L10; default: 1, L9's single-rank engine)")
    p.add_argument("--tp-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds a rank waits in a collective before the engine fails (default: {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--speculative", choices=("ngram", "draft"),
                   help="L11: draft tokens each decode step, verified in the same forward: ngram (prompt lookup) "
                        "or draft (a draft model, --draft-model) (default: none, L9's and L10's engine)")
    p.add_argument("--num-speculative-tokens", type=int,
                   help=f"most draft tokens per request per step (default: {DEFAULT_NUM_SPECULATIVE_TOKENS}; "
                        f"needs --speculative)")
    p.add_argument("--draft-model", help="with --speculative draft: a Qwen3 checkpoint directory or hub id with the "
                   "target's tokenizer (default: the target's own checkpoint)")
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES,
                   help="L12: how the KV pool stores K and V: auto (the model's dtype, every earlier lesson's pool), "
                        "int8 (one fp32 scale per token and KV head) or fp8 (e4m3 pages); without --num-blocks a "
                        "quantized pool gets the bytes of the default pool in the model's dtype, so it holds more "
                        "blocks (default: auto)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="L14: a request's logits are bitwise the same whatever else the server runs (CPU, --tp 1)")
    p.add_argument("--kv-role", default="kv_both", choices=KV_ROLES,
                   help="L15: kv_producer prefills and leases each prompt's pages to a decode server; kv_consumer "
                        "pulls them from one before it decodes; kv_both serves alone, as before (default: kv_both)")
    p.add_argument("--kv-port", type=int, help="L15, kv_producer: the port its page server listens on, on --host "
                   "(default: 0, a free one; the lease in each answer says which)")
    p.add_argument("--kv-lease-s", type=float, help=f"L15, kv_producer: seconds a prompt's pages wait for the decode "
                   f"server to pull them before they are freed (default: {DEFAULT_LEASE_S:g}, vLLM's)")
    p.add_argument("--kv-load-failure-policy", choices=POLICIES,
                   help="L15, kv_consumer: when a pull fails, recompute the prompt or refuse the request with a 502 "
                        "(default: recompute)")
    p.add_argument("--weights", choices=WEIGHTS,
                   help="L16: the model's matrices: fp32 | bf16 (the checkpoint in that dtype, as --dtype) | q8_0 | "
                        "q4_1 (GGUF weight blocks on the CPU, fp32 activations: a named model's shipped file where it "
                        "ships that format, smollm2's q4_1, else quantized from the checkpoint at load) (default: the "
                        "model's dtype)")
    p.add_argument("--pool-viewer", action="store_true",
                   help="also serve the KV pool, live, at /pool (read-only; a recorder follows every step)")
    p.add_argument("--trace", metavar="FILE", help="write the pool trace (JSON lines, one per step) here; "
                                                 "python scripts/pool_viewer.py --trace FILE draws it")
    p.add_argument("--seed", type=int, default=0, help="engine seed for requests that give none (default: 0)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests queued for admission before new ones get 429 (default: 256)")
    p.add_argument("--default-max-tokens", type=int, default=256,
                   help="max_tokens of a request that gives none (default: 256)")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="larger bodies get 413 (default: 1 MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds open requests get to finish after SIGTERM, then a 503 (default: 10)")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level (default: warning)")
    p.add_argument("--loop", default="asyncio", choices=("asyncio", "uvloop", "auto"),
                   help="event loop (default: asyncio; uvloop needs uvicorn's standard extra)")
    p.add_argument("--http", default="h11", choices=("h11", "httptools", "auto"),
                   help="HTTP parser (default: h11; httptools needs uvicorn's standard extra)")
    return p


# Seconds between the end of --shutdown-timeout, when the engine thread answers every open request with
# 503, and uvicorn cancelling the handlers still open: time for the step under way to end and for each
# handler to send its 503. A handler uvicorn cancels sends a 500, or cuts its stream without a word.
SHUTDOWN_FLUSH_S = 2.0


class Server(uvicorn.Server):
    """uvicorn's server, with three changes: it prints where it serves once it answers; requests still open
    when the grace period ends get a 503; and a SIGTERM ends it with exit status 0 (uvicorn re-raises the
    signal after its graceful shutdown, which would kill us)."""

    def __init__(self, config: uvicorn.Config, loop: EngineLoop, banner: str, grace: float):
        super().__init__(config)
        self.engine_loop, self.banner, self.grace = loop, banner, grace

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            print(self.banner, flush=True)

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's shutdown waits up to its timeout (grace + SHUTDOWN_FLUSH_S) for open requests. After
        `grace`, the engine thread stops and answers each with a 503 (in-band on a stream), so every handler
        ends by itself before uvicorn would cancel it."""
        deadline = asyncio.create_task(self._stop_engine_after_grace())
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    async def _stop_engine_after_grace(self) -> None:
        await asyncio.sleep(self.grace)
        await asyncio.to_thread(self.engine_loop.stop)

    def handle_exit(self, sig, frame) -> None:
        self.engine_loop.accepting = False  # new requests get 503 while open streams finish
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def positive(value: int, name: str) -> None:
    if value < 1:
        raise CourseError(f"{name} must be at least 1, got {value}")


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, with Nagle's algorithm off for every connection it accepts (Linux copies the option).

    asyncio turns Nagle off itself only on sockets whose protocol number says TCP, and create_server's
    socket says 0: left on, a response's body waits behind its headers for the client's delayed ACK
    (about 40 ms on Linux), and so does every SSE event behind the one before it."""
    try:
        sock = socket.create_server((host, port))
    except OSError as e:
        raise CourseError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def check_speculation(args) -> None:
    """L11's flags, refused before anything loads when they cannot mean anything."""
    if args.speculative is None and args.num_speculative_tokens is not None:
        raise CourseError("--num-speculative-tokens needs --speculative ngram or --speculative draft")
    if args.draft_model is not None and args.speculative != "draft":
        raise CourseError("--draft-model needs --speculative draft")
    if args.num_speculative_tokens is not None:
        positive(args.num_speculative_tokens, "--num-speculative-tokens")
    if args.draft_model is not None:
        path = Path(args.draft_model).expanduser()
        if path.exists() and not path.is_dir():
            raise CourseError(f"--draft-model {args.draft_model}: not a directory")
        if not path.exists() and not HUB_ID.match(args.draft_model):
            raise CourseError(f"--draft-model {args.draft_model}: no such directory")


def make_drafter(args, model_dir: Path, dtype: torch.dtype, device: torch.device):
    """L11's drafter for --speculative (None without it), and what the `engine:` line adds about it."""
    if args.speculative is None:
        return None, ""
    k = args.num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS
    if args.speculative == "ngram":
        return NgramDrafter(), f" · speculative ngram k={k}"
    # A checkpoint drafting for itself guesses what it will say (acceptance ~100% greedy) and saves nothing: a
    # demonstration and a test, not a speed-up. A real draft model is a smaller one with the same tokenizer.
    draft_dir = model_dir if args.draft_model is None else resolve_model_dir(args.draft_model, lambda: model_dir)
    Qwen3Config.from_dir(draft_dir)
    tensor_shapes(draft_dir)  # missing or corrupt weights fail here, before loading
    whose = " (the target's own checkpoint)" if args.draft_model is None else ""
    drafter = DraftModelDrafter(Qwen3ForCausalLM.from_dir(draft_dir, dtype, device), args.backend)
    return drafter, f" · speculative draft k={k} · draft-model {draft_dir}{whose}"


def check_kv_role(args) -> dict:
    """L15's flags, refused in one line when they cannot mean anything; the connector's options."""
    for value, flag, role in ((args.kv_port, "--kv-port", "kv_producer"),
                              (args.kv_lease_s, "--kv-lease-s", "kv_producer"),
                              (args.kv_load_failure_policy, "--kv-load-failure-policy", "kv_consumer")):
        if value is not None and args.kv_role != role:
            raise CourseError(f"{flag} is a {role} server's: it needs --kv-role {role}")
    if args.kv_role == "kv_both":
        return {}
    if args.tp != 1:
        raise CourseError(f"--kv-role {args.kv_role} runs at --tp 1, not {args.tp}: pages move between two single-rank "
                          f"engines here")
    if args.kv_role == "kv_consumer":
        return {"policy": args.kv_load_failure_policy or "recompute"}
    port = 0 if args.kv_port is None else args.kv_port
    if not 0 <= port < 65536:
        raise CourseError(f"--kv-port must be in [0, 65535], got {port}")
    lease_s = DEFAULT_LEASE_S if args.kv_lease_s is None else args.kv_lease_s
    if not 0 < lease_s < float("inf"):  # NaN too
        raise CourseError(f"--kv-lease-s must be a positive number of seconds, got {args.kv_lease_s}")
    return {"host": args.host, "port": port, "lease_s": lease_s}


def check_weights_options(args) -> None:
    """L16's --weights, refused in one line when another option contradicts it; sets the dtype and device it
    implies (blocks: fp32 on the CPU)."""
    args.dtype, args.device = check_weights(args.weights, args.dtype, args.device)
    if args.weights in QUANTIZED and args.tp != 1:
        raise CourseError(f"--weights {args.weights} runs at --tp 1, not {args.tp}: the block kernel serves one "
                          f"process's whole matrices, not a rank's slices")


def load_model(args, model_dir: Path, dtype: torch.dtype, device: torch.device) -> tuple[Qwen3ForCausalLM, str]:
    """The single-rank model --weights asks for, and what the `engine:` line adds about it."""
    if args.weights not in QUANTIZED:
        return Qwen3ForCausalLM.from_dir(model_dir, dtype, device), ""
    if args.model in NAMED and args.weights == "q4_1":  # the blocks a named model ships, no fp32 matrix made
        gguf = gguf_path(NAMED[args.model])
        return gguf_model(model_dir, gguf), f" · weights q4_1 ({gguf.name} as shipped)"
    dense = Qwen3ForCausalLM.from_dir(model_dir, torch.float32, device)
    return quantized_model(dense, args.weights), f" · weights {args.weights} (quantized at load)"


def build(args) -> tuple[Server, socket.socket]:
    for value, name in ((args.max_waiting, "--max-waiting"), (args.default_max_tokens, "--default-max-tokens"),
                        (args.max_body_bytes, "--max-body-bytes")):
        positive(value, name)
    if not args.shutdown_timeout >= 0:  # NaN too
        raise CourseError(f"--shutdown-timeout must be at least 0, got {args.shutdown_timeout}")
    if args.threads is not None:
        positive(args.threads, "--threads")
        torch.set_num_threads(args.threads)
    for module in {args.loop, args.http} & {"uvloop", "httptools"}:  # asked for by name: say so if missing
        if importlib.util.find_spec(module) is None:
            raise CourseError(f"{module} is not installed: pip install 'uvicorn[standard]', or keep the default")
    if not 0 <= args.port < 65536:
        raise CourseError(f"--port must be in [0, 65535], got {args.port}")
    check_speculation(args)
    connector_args = check_kv_role(args)
    check_weights_options(args)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.batch_invariant and args.tp != 1:
        raise CourseError(f"--batch-invariant runs at --tp 1, not {args.tp}: ranks that split a matmul add their "
                          f"partial sums in another order than one rank does")
    if args.kv_dtype == "int8":  # int8 pages are read by the C++ CPU kernel or the torch oracle: say so before loading
        int8_backend(args.backend, device)
    model_dir = resolve_model_dir(args.model, default_model_dir)
    config = Qwen3Config.from_dir(model_dir)
    tensor_shapes(model_dir)  # missing or corrupt weights fail here, before loading
    tokenizer = load_tokenizer(model_dir)
    token_bytes = TokenBytes(tokenizer)
    sock = listen(args.host, args.port)  # before loading the model: a busy port is reported in a second
    drafter, spec_line = make_drafter(args, model_dir, dtype, device)  # a bad draft model fails before ranks start
    weights_line = ""
    if args.tp == 1:
        model, weights_line = load_model(args, model_dir, dtype, device)
    else:  # L10: rank 0 (this process) serves; the other ranks follow its steps
        check_tp(config, args.tp)
        model = TpQwen3ForCausalLM.load(model_dir, dtype, start(args.tp, device, args.tp_timeout))
    # L14's engine: L13's (L12's pool, L11's drafts, grammars) with a batch-invariant mode, off unless asked for. A
    # request without a grammar, on a server without --speculative, --kv-dtype or --batch-invariant, runs L9's step
    # exactly (L10's at --tp > 1).
    engine_class = L14Engine if args.tp == 1 else L13TpEngine
    invariant = {"batch_invariant": True} if args.batch_invariant else {}
    speculation = {}
    if drafter is not None:  # L11: drafts in the decode rows
        speculation = dict(drafter=drafter,
                           num_speculative_tokens=args.num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS)
    quantized_kv = {}  # with the default --kv-dtype auto: the pool in the model's dtype, as every earlier lesson
    if args.kv_dtype != "auto":  # L12: int8 pages, the pool sized in bytes
        quantized_kv = dict(kv_dtype=args.kv_dtype)
    kv_role = {}  # L15: a prefill or decode engine, L14's otherwise
    if args.kv_role != "kv_both":
        engine_class, kv_role = L15Engine, dict(kv_role=args.kv_role, connector_args=connector_args)
    if args.weights in QUANTIZED:  # L16: L15's engine (any --kv-role) with the setups blocks cannot run refused
        engine_class = L16Engine
    try:
        engine = engine_class(model, args.block_size, args.num_blocks, args.max_running, args.backend,
                              graphs=args.graphs == "on", max_batched_tokens=args.max_batched_tokens,
                              max_slice_tokens=args.max_slice_tokens, max_long_prefills=args.max_long_prefills,
                              long_prefill_threshold=args.long_prefill_threshold, seed=args.seed, **speculation,
                              **quantized_kv, **invariant, **kv_role)
    except OSError as e:
        if args.kv_role != "kv_producer":
            raise
        # P's page server could not listen (a busy --kv-port): one line, as for the HTTP port
        raise CourseError(f"--kv-port {connector_args['port']}: cannot listen on {args.host}: {e.strerror}") from None
    engine.stats.record_timeline = False
    live, outs = None, []
    if args.trace is not None:
        try:
            outs.append(open(args.trace, "w", buffering=1))  # line-buffered: a server stopped leaves whole lines
        except OSError as e:
            raise CourseError(f"--trace {args.trace}: {e.strerror}") from None
    if args.pool_viewer:
        live = LivePool(decode=lambda token: tokenizer.decode([token]))
        outs.append(live)
    if outs:  # attached before the engine thread starts: every step is recorded, from the first
        lesson = "l15" if kv_role else "l14" if args.tp == 1 else "l13"
        PoolRecorder(engine, outs[0] if len(outs) == 1 else Tee(*outs), lesson)
    kv_line = ""
    if args.kv_dtype != "auto":
        kv_line = f" · kv-dtype {args.kv_dtype} · kv-blocks {engine.allocator.num_blocks}"
    # What a benchmark's conditions line needs from the server itself: the backend `auto` resolved to, the threads.
    role_line = ""
    if args.kv_role == "kv_producer":
        role_line = (f" · kv-role kv_producer · kv-port {engine.producer.server.address[1]}"
                     f" · kv-lease-s {connector_args['lease_s']:g}")
    elif args.kv_role == "kv_consumer":
        role_line = f" · kv-role kv_consumer · kv-load-failure-policy {connector_args['policy']}"
    print(f"engine: backend {engine.runner.backend.name} · threads {torch.get_num_threads()} · device {device.type}"
          f" · dtype {str(dtype).removeprefix('torch.')}{weights_line}{spec_line}{kv_line}"
          f"{' · batch-invariant' if args.batch_invariant else ''}{role_line}", flush=True)
    chat = ChatTemplate(model_dir)
    name = args.served_model_name or (args.model if args.model and not Path(args.model).exists() else model_dir.name)
    served = ServedModel(name, tokenizer, chat if chat.available else None, config.max_position_embeddings,
                         config.vocab_size)
    loop_class = EngineLoop if args.kv_role == "kv_both" else KvEngineLoop  # L15: P leases, D pulls
    loop = loop_class(engine, token_bytes, ServerMetrics(), frozenset(config.eos_token_ids), args.max_waiting)
    # L13: response_format and structured_outputs, compiled by llguidance (its tokenizer loads at the first grammar)
    structured = StructuredOutputs(tokenizer, config.vocab_size, frozenset(config.eos_token_ids), loop.metrics.registry)
    if args.kv_role == "kv_both":
        app = create_app(served, loop, args.default_max_tokens, args.max_body_bytes, structured)
    else:  # L15: kv_transfer_params taken before L9's checks, D's 503s for want of room with Retry-After
        app = create_kv_app(served, loop, args.default_max_tokens, args.max_body_bytes, structured)
    if live is not None:
        add_routes(app, live)
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    # asyncio and h11, not uvloop and httptools (uvicorn[standard]): measured on the course's 2-core box, the
    # engine thread got more done beside asyncio's loop (docs/l9_server_appendix.md): the event loop is a few
    # percent of a core here, and what decides throughput is the engine thread's share of the GIL and the CPU.
    config = uvicorn.Config(app, log_level=args.log_level, loop=args.loop, http=args.http,
                            timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_FLUSH_S)
    banner = f"serving {name} at http://{url_host}:{port}/v1"
    if live is not None:
        banner += f"\nthe pool, live, at http://{url_host}:{port}/pool"  # a line of its own: clients read the first
    return Server(config, loop, banner, args.shutdown_timeout), sock


def main() -> None:
    follow_if_torchrun()  # under torchrun, ranks above 0 follow rank 0's steps and never serve
    args = parser().parse_args()
    try:
        server, sock = build(args)
    except CourseError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    except RunFailure as e:  # a tensor-parallel rank died while loading
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1)
    try:
        server.run(sockets=[sock])
    finally:
        if isinstance(server.engine_loop.engine, (L10Engine, L15Engine)):
            server.engine_loop.engine.close()  # the followers stop with the server; P's page server closes


if __name__ == "__main__":
    main()
