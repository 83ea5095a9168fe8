"""L11 smoke: speculative decoding. A drafter guesses up to K tokens per decoding request; one forward checks
them all, the target's own token ends each row, and the pages past what was kept go back. The workload is
L10's (four short requests decode while a long prompt arrives and is cut into slices; a later prompt shares
most of the long one, a prefix hit) plus a prompt that repeats itself, so the n-gram drafter has something
to look up. Every request's greedy tokens must equal HF's for that prompt alone, and L9's (the same engine
without speculation, same arrivals). The report gives drafted and accepted tokens and the target forwards saved.

    python scripts/l11_smoke.py                              # n-gram (prompt lookup) drafts, K = 4
    python scripts/l11_smoke.py --drafter draft              # the target model drafts for itself
    python scripts/l11_smoke.py --drafter draft --draft-model DIR --num-speculative-tokens 2
    python scripts/l11_smoke.py --drafter draft --draft-layers 2  # early exit: the target's first 2 layers
    python scripts/l11_smoke.py --tp 2                       # L11 over L10's split model, rank 1 spawned here
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lessons.l3_block_tensor.backends import BACKENDS  # noqa: E402
from lessons.l4_continuous.engine import DEFAULT_MAX_RUNNING, Arrival  # noqa: E402
from lessons.l8_chunked_prefill.scheduler import DEFAULT_MAX_BATCHED_TOKENS  # noqa: E402
from lessons.l9_server.engine import L9Engine  # noqa: E402
from lessons.l10_tensor_parallel.group import DEFAULT_TIMEOUT_S  # noqa: E402
from lessons.l10_tensor_parallel.launch import follow_if_torchrun, start  # noqa: E402
from lessons.l10_tensor_parallel.layout import check_tp  # noqa: E402
from lessons.l10_tensor_parallel.model import TpQwen3ForCausalLM  # noqa: E402
from lessons.l11_speculative import L11Engine, L11TpEngine  # noqa: E402
from lessons.l11_speculative.draft_model import DraftModelDrafter  # noqa: E402
from lessons.l11_speculative.early_exit import early_exit  # noqa: E402
from lessons.l11_speculative.engine import DEFAULT_NUM_SPECULATIVE_TOKENS, check_num_speculative_tokens  # noqa: E402
from lessons.l11_speculative.ngram import NgramDrafter  # noqa: E402
from l8_smoke import LONG, SHORT  # noqa: E402  (scripts/ is on the path when a smoke runs)
from l10_smoke import SEQUEL  # noqa: E402
from shared.cli import HUB_ID, resolve_model_dir, smoke_parser  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.smoke import main  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

# A prompt that repeats one pattern, " the <word>", 24 times. The embedded model has random weights: it never
# copies its context, and the n-gram drafter's lookup key always ends with the model's newest token, so on
# ordinary prompts it finds no earlier occurrence and proposes nothing. This one was picked by a search over
# such prompts (5,120 of them) as one whose first generated token, " glass", follows an earlier " the": the
# first decode finds " the glass" in the prompt and proposes what came after it there. The model's top choice
# leads its runner-up by 2.8 logits, so bf16 picks it too.
REPEAT = (" the horn the cat the iron the road the child the glass the coat the bird the stone the grape the roof "
          "the rain the leaf the horse the bed the tree the king the cloud the sand the wind the lamp the river "
          "the copper the queen the")
DEFAULT_PROMPTS = [*SHORT, REPEAT, LONG, "1, 2, 3, 4,", SEQUEL]
DRAFTERS = ("ngram", "draft")


def arrival_step(i: int) -> int:
    """L10's arrivals: the short ones at once and the repeating one a step later (its drafts have room in
    the budget before the long prompt takes it), the long one and the count at step 4, the sequel at 16,
    once the long prompt's blocks are in the prefix cache."""
    return 0 if i < len(SHORT) else 1 if i == len(SHORT) else 4 if i < len(SHORT) + 3 else 16


def speculative_tokens(text: str) -> int:
    """K from the command line: a whole number of at least 0, refused at parse time (one line, exit 2)."""
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if k < 0:
        raise argparse.ArgumentTypeError(f"{k} is below 0 (0 turns speculation off)")
    return k


def draft_model_dir(text: str) -> str:
    """--draft-model: an existing directory (or a hub id, downloaded like --model's), checked before any load."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a directory")
    if not path.exists() and not HUB_ID.match(text):
        raise argparse.ArgumentTypeError(f"directory {text} does not exist")
    return text


def parser():
    p = smoke_parser("L11", __doc__.split("\n\n")[0], blocks=True, default_prompts=DEFAULT_PROMPTS)
    p.add_argument("--drafter", default="ngram", choices=DRAFTERS,
                   help="ngram: prompt lookup in the request's own tokens; draft: a draft model (default: ngram)")
    p.add_argument("--draft-model", type=draft_model_dir, help="checkpoint directory of the draft model for --drafter draft, same "
                                         "tokenizer as the target (default: the target model itself drafting for "
                                         "itself, so greedy drafts are all accepted)")
    p.add_argument("--draft-layers", type=int, help="for --drafter draft: the target's own first N layers, then its "
                   "final norm and LM head, draft (early exit; instead of --draft-model)")
    p.add_argument("--num-speculative-tokens", type=speculative_tokens, default=DEFAULT_NUM_SPECULATIVE_TOKENS,
                   help=f"K, most drafts per request per step; 0: no speculation (default: "
                        f"{DEFAULT_NUM_SPECULATIVE_TOKENS})")
    p.add_argument("--tp", type=int, default=1, help="ranks the target model is split across (default: 1)")
    p.add_argument("--tp-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds a rank waits in a collective before the run fails (default: {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--max-batched-tokens", type=int, default=DEFAULT_MAX_BATCHED_TOKENS,
                   help=f"the token budget of one step, drafts included (default: {DEFAULT_MAX_BATCHED_TOKENS})")
    p.add_argument("--max-slice-tokens", type=int, help="most prompt tokens one request computes in a step")
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="attention kernels (as in L3)")
    p.add_argument("--max-running", type=int, default=DEFAULT_MAX_RUNNING, help="most requests in one step")
    p.add_argument("--graphs", default="on", choices=("on", "off"), help="off: every step eager")
    return p


def load_draft_model(args, target: Qwen3ForCausalLM) -> Qwen3ForCausalLM:
    """--draft-model DIR, loaded in the target's dtype on its device; --draft-layers N: the target's first N
    layers; neither: the target itself."""
    if args.draft_layers is not None:
        return early_exit(target, args.draft_layers)
    if args.draft_model is None:
        return target
    path = resolve_model_dir(args.draft_model, default_model_dir)
    weight = target.lm_head.weight
    return Qwen3ForCausalLM.from_dir(path, weight.dtype, weight.device)


def build_engines(model, args):
    check_num_speculative_tokens(args.num_speculative_tokens)  # before anything is loaded or started
    if (args.draft_model is not None or args.draft_layers is not None) and args.drafter != "draft":
        raise CourseError("--draft-model and --draft-layers need --drafter draft")
    if args.draft_model is not None and args.draft_layers is not None:
        raise CourseError("--draft-model and --draft-layers are two draft models: give one")

    def engine(cls, m, **spec):
        return cls(m, args.block_size, args.num_blocks, args.max_running, args.backend, graphs=args.graphs == "on",
                   max_batched_tokens=args.max_batched_tokens, max_slice_tokens=args.max_slice_tokens, **spec)

    def workload(prompts, stop):
        return [Arrival(p, stop, step=arrival_step(i)) for i, p in enumerate(prompts)]

    def l11(prompts, stop):
        try:
            return args.l11.run(workload(prompts, stop))
        finally:
            if args.tp > 1:
                args.l11.close()  # the followers stop now: L9's and HF's runs get the CPU to themselves

    def l9(prompts, stop):
        args.l9 = engine(L9Engine, model)
        return args.l9.run(workload(prompts, stop))

    check_tp(model.config, args.tp)
    engine(L9Engine, model)  # bad engine options (a budget below 1, a block size) fail here, on one rank
    args.drafter_obj = (NgramDrafter() if args.drafter == "ngram"
                        else DraftModelDrafter(load_draft_model(args, model), args.backend))
    spec = {"drafter": args.drafter_obj, "num_speculative_tokens": args.num_speculative_tokens}
    if args.tp == 1:
        args.l11 = engine(L11Engine, model, **spec)  # a draft model of another vocabulary is refused here
    else:
        group = start(args.tp, model.lm_head.weight.device, args.tp_timeout)
        tp_model = TpQwen3ForCausalLM.load(resolve_model_dir(args.model, default_model_dir),
                                           model.lm_head.weight.dtype, group)
        try:
            args.l11 = engine(L11TpEngine, tp_model, **spec)
        except CourseError:
            group.close()  # the followers are waiting for a first step that will never come
            raise
    return {"L11": l11, "L9": l9}


def spec_report(model, setup, args):
    eng, base = args.l11, args.l9
    spec, k = eng.spec, args.num_speculative_tokens
    leak = eng.allocator.num_free != eng.usable_blocks
    steps, plain_steps = len(eng.step_tokens), len(base.step_tokens)
    ok = not leak
    demanded = args.prompt is None and k > 0  # the default workload must exercise the drafts
    if demanded:
        ok = ok and spec.drafted > 0
    if args.drafter == "ngram":
        who = "n-gram drafter (prompt lookup, n 4..2)"
    elif args.draft_layers is not None:
        who = f"early-exit draft: the target's first {args.draft_layers} layers"
    elif args.draft_model is None:
        who = "draft model: the target itself drafting for itself (no --draft-model)"
    else:
        who = f"draft model {args.draft_model}"
    draft_forwards = (f"; {args.drafter_obj.forwards} draft-model forwards"
                      if isinstance(args.drafter_obj, DraftModelDrafter) else "")
    ranks = "" if args.tp == 1 else f" on {args.tp} ranks"
    line = (f"L11{ranks}, K = {k}, {who}: {spec.line()}"
            f"{' (NOTHING DRAFTED on the default workload)' if demanded and not spec.drafted else ''}\n"
            f"  {steps} target forwards (steps) with speculation, {plain_steps} without (L9, same arrivals): "
            f"{plain_steps - steps} saved{draft_forwards}; {eng.allocator.num_free} of {eng.usable_blocks} usable "
            f"blocks free or cached at the end{' (LEAK)' if leak else ''}")
    return ok, line


if __name__ == "__main__":
    follow_if_torchrun()  # under torchrun, ranks above 0 follow rank 0 and never get here
    main("L11", parser(), build_engines, spec_report)
