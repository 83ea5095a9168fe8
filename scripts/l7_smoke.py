"""L7 smoke: CUDA graphs (on CPU: the same static-buffer runner, with no capture). Requests arrive in pairs
every 3 steps, so the decode batch grows 2 -> 4 -> 6 -> 8 -> 10 and shrinks as they finish, crossing the
captured sizes 2, 4, 8 and 16 both ways. Every request's greedy tokens must equal HF's for that prompt
alone, and L6's; the report counts decode steps run from a captured size, steps run eagerly (prefill,
or above the largest size) and the padding overhead (padded rows / real rows)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's lessons/ and shared/, not an installed course's
from lessons.l3_block_tensor.backends import BACKENDS  # noqa: E402
from lessons.l4_continuous.engine import DEFAULT_MAX_RUNNING, Arrival  # noqa: E402
from lessons.l6_prefix_sharing import L6Engine  # noqa: E402
from lessons.l7_cuda_graphs import L7Engine  # noqa: E402
from shared.cli import smoke_parser  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.smoke import main  # noqa: E402

DEFAULT_PROMPTS = [
    "The capital of France is",
    "Hello, world!",
    "Paged attention stores the key/value cache in fixed-size blocks",
    "a",
    "Once upon a time, in a small town by the sea,",
    "def fibonacci(n):",
    "The quick brown fox",
    "CUDA graphs record a sequence of kernel launches",
    "1, 2, 3, 4,",
    "Why is the sky blue?",
]


def arrival_step(i: int) -> int:
    return 3 * (i // 2)  # two at a time, every third step: two decode-only steps between arrivals


def parser():
    p = smoke_parser("L7", __doc__, blocks=True, default_prompts=DEFAULT_PROMPTS, block_size=4)
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="attention kernels (as in L3)")
    p.add_argument("--max-running", type=int, default=DEFAULT_MAX_RUNNING, help="most requests in one step")
    p.add_argument("--graphs", default="on", choices=("on", "off"), help="off: every step eager (L6's path)")
    p.add_argument("--capture-sizes", help="comma-separated batch sizes to capture (default: 1,2,4,8, then every 8)")
    return p


def parse_sizes(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise CourseError(f"--capture-sizes {text!r}: use comma-separated integers, e.g. 1,2,4,8")


def build_engines(model, args):
    sizes, graphs = parse_sizes(args.capture_sizes), args.graphs == "on"

    def workload(prompts, stop):
        return [Arrival(p, stop, step=arrival_step(i)) for i, p in enumerate(prompts)]

    def l7(prompts, stop):
        args.l7 = L7Engine(model, args.block_size, args.num_blocks, args.max_running, args.backend, graphs=graphs,
                           capture_sizes=sizes)
        return args.l7.run(workload(prompts, stop))

    def l6(prompts, stop):
        return L6Engine(model, args.block_size, args.num_blocks, args.max_running, args.backend).run(workload(prompts, stop))

    L7Engine(model, args.block_size, args.num_blocks, args.max_running, args.backend, graphs=graphs,
             capture_sizes=sizes)  # bad options fail here, before any run
    return {"L7": l7, "L6": l6}


def graph_report(model, setup, args):
    eng, r = args.l7, args.l7.runner
    graph_steps = sum(r.replays.values())
    leak = eng.allocator.num_free != eng.usable_blocks  # every block free or cached, except the dummy
    once = all(n == 1 for n in r.captures.values())
    ok = not leak and once and (graph_steps > 0 or args.graphs == "off" or args.prompt is not None)
    mode = ("graphs off: every step eager" if not r.sizes else "CUDA graphs" if r.uses_cuda_graphs
            else "static buffers, no capture (not CUDA + FlashInfer)")
    per_size = ", ".join(f"{s}: {n}" for s, n in sorted(r.replays.items())) or "none"
    overhead = r.padded_rows / r.real_rows if r.real_rows else 0.0
    line = (f"L7 ({mode}): {graph_steps} decode step(s) from a captured size ({per_size}), {r.eager_steps} eager; "
            f"padding overhead {r.padded_rows} padded / {r.real_rows} real rows = {overhead:.0%}; "
            f"sizes {r.sizes or 'none (--graphs off)'}, each captured {'once' if once else 'MORE THAN ONCE'}; "
            f"dummy block {eng.dummy_block}; {eng.allocator.num_free} of {eng.usable_blocks} usable blocks free "
            f"or cached at the end{' (LEAK)' if leak else ''}")
    return ok, line


if __name__ == "__main__":
    main("L7", parser(), build_engines, graph_report)
