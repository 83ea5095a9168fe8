"""Parity matrix: every lesson's smoke over block sizes, dtypes and prompt sets, in one table.

    OMP_NUM_THREADS=1 python scripts/checks/parity_matrix.py            # the full grid, one smoke at a time
    python scripts/checks/parity_matrix.py --lessons l2,l5 --dtypes float32

Lessons are found as scripts/l<N>_smoke.py, so a new lesson joins the grid by existing. Each cell is one
smoke run with --json, judged from its exit status and JSON (see `classify`):
PASS every engine's tokens equal HF's; TIE the smoke exits 0 and every difference is a half-precision
numerical tie (our token is HF's runner-up within the dtype's rounding, or HF's own fp32 run picks it; after
the first tie HF scores our own tokens, so every later position is judged too, see docs/maintainers.md); FAIL a
real mismatch or a failed lesson-specific check; ERROR no complete verdict (crash, bad option, timeout, no
JSON, or a passing verdict that did not judge every token). A lesson whose smoke has no --block-size runs
once per dtype and prompt set. The summary counts the positions judged against the tokens generated.
--skip-no-arg-runs leaves out the one cell per smoke that a run with no arguments computes, for .ci/run, which
has just made exactly that run of every smoke, as a user does, and stopped on its exit status.
--skip-repeated-runs leaves out the cells whose every engine another row's cell runs again (REPEATED_IN), for
.ci/run too: each engine is still judged once per dtype, prompt set and block size.
--model runs every smoke on another checkpoint (a directory, or smollm2: the real model's row in .ci/run), --tp
gives L10 its ranks (smollm2's 9 heads need 3), and the chat prompt set renders two questions with the
checkpoint's own chat template.
Exit 0 when no cell is FAIL or ERROR, 1 otherwise, 2 for bad options.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from shared.cli import DTYPES, OneLineParser  # noqa: E402
from shared.errors import CourseError  # noqa: E402

SMOKE = re.compile(r"^l(\d+)_smoke\.py$")
# Over 200 characters: CJK, emoji (one a ZWJ sequence), Latin accents, Greek, Cyrillic, Arabic and math,
# already NFC, so byte-level BPE splits multi-byte characters across tokens and the cache must still agree.
UNICODE_PROMPT = (
    "Ünïcödé check: 東京の桜は三月に咲き始め、北京的秋天很美，서울의 밤은 길다. Emoji 🚀🔥🙂👩‍💻 and "
    "accents: café, naïve, façade, jalapeño, Øresund, Łódź, crème brûlée. Ελληνικά και русский текст, "
    "العربية أيضاً — «quotes», ∑∞≈π, ½ ¾, and then the story goes on:"
)
# chat: questions rendered by the checkpoint's own chat template (chat_prompts), filled in when the grid is made
CHAT_QUESTIONS = ["What is the capital of France? Answer in one sentence.",
                  "Give me a JSON object with fields name and age for Ana, 31."]
PROMPT_SETS = {"default": None, "unicode": [UNICODE_PROMPT], "chat": []}  # None: the smoke's own default prompts
DEFAULT_PROMPT_SETS = ["default", "unicode"]  # chat when asked for (.ci/run's real-model row)
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
STYLE = {"PASS": "green", "TIE": "yellow", "FAIL": "bold red", "ERROR": "bold magenta"}


@dataclass(frozen=True)
class Cell:
    lesson: str  # "L3"
    script: Path
    dtype: str
    prompts: str  # a PROMPT_SETS key
    block_size: int | None  # None: the smoke has no blocks
    options: tuple[str, ...] = ()  # the lesson's own options (LESSON_OPTIONS), the same in every cell of its row
    model: str | None = None  # --model for every cell (a directory or a named model); None: the embedded model

    def argv(self, max_new_tokens: int, device: str | None) -> list[str]:
        args = [sys.executable, str(self.script), "--json", "--dtype", self.dtype, *self.options]
        args += [] if self.model is None else ["--model", self.model]
        args += ["--max-new-tokens", str(max_new_tokens)]
        args += [] if self.block_size is None else ["--block-size", str(self.block_size)]
        args += [] if device is None else ["--device", device]
        for text in PROMPT_SETS[self.prompts] or []:
            args += ["--prompt", text]
        return args


@dataclass(frozen=True)
class Outcome:
    status: str  # PASS, TIE, FAIL or ERROR
    note: str = ""  # what a reader needs when it is not PASS
    judged: int = 0  # positions the parity rule judged, over every engine and prompt of the run
    tokens: int = 0  # tokens those engines generated: a complete verdict judged all of them


def discover(scripts_dir: Path) -> list[Path]:
    """scripts/l<N>_smoke.py in lesson order (l10 after l9, not after l1)."""
    found = [p for p in scripts_dir.iterdir() if SMOKE.match(p.name)]
    return sorted(found, key=lambda p: int(SMOKE.match(p.name).group(1)))


def has_blocks(help_text: str) -> bool:
    return "--block-size" in help_text


def no_arg_cell(script: Path, help_text: str, on_cuda: bool) -> Cell:
    """The cell a smoke run with no arguments computes: its default prompts and block size (read from its --help,
    "tokens per KV block (default: N)"), float32 on the CPU and bfloat16 on CUDA (shared/cli.py's defaults). A
    smoke whose no-argument run makes more than the matrix's 20 tokens (L13's 64) judges this cell's 20 within it."""
    flat = " ".join(help_text.split())  # argparse wraps help to the terminal's width
    size = re.search(r"tokens per KV block \(default: (\d+)\)", flat) if has_blocks(help_text) else None
    if has_blocks(help_text) and size is None:
        raise ValueError(f"{script.name} --help names --block-size without its default")
    return Cell("L" + SMOKE.match(script.name).group(1), script, "bfloat16" if on_cuda else "float32", "default",
                None if size is None else int(size.group(1)))


# Lessons whose block tables are an earlier lesson's: L9 serves L8's engine, L10 splits its model across ranks.
# L8's cells sweep every block size; theirs run at the largest one asked for, checking what they add (the
# server, the split) at a third of the cost (a cell starts a server or a second rank).
L8_BLOCK_TABLES = {"L9", "L10"}
# Lessons whose block sizes a test sweeps more thoroughly than three smoke runs: L11's drafts crossing block
# boundaries and rolling back run at block sizes drawn from 1 to 16 (1, 4 and 16 always among them) in
# tests/test_l11_invariants.py: seeded workloads, every step's invariants, every output against L9's engine (whose
# tokens the matrix checks against HF's at every block size). Their cells, too, run at the largest block size
# only: L11's 12 runs took 124 s of the CI matrix (a 2-core box at load 1); its 4 keep HF parity with drafts.
# L12's HF parity is its --kv-dtype auto (LESSON_OPTIONS), L11's engine and runner class exactly, swept there too;
# its int8 pages have no parity to check (its no-argument run, made by .ci/run, checks the quality contract).
# L13 masks the logits of constrained rows and leaves the block tables, the pool and the runner L12's (kv auto:
# L11's); its row runs at the largest block size too, 4 cells like L11's and L12's, each judging the engine and
# the same requests through scripts/serve.py. Its smoke makes 64 new tokens with no arguments (the JSON needs about
# 45), the matrix 20: the no-argument run judges every one of its positions, so the cell it stands for (fp32,
# default prompts and block size, 20 tokens) is that run's first 20, with the same batch at every step.
# L14's engine is L13's with another matmul and RMSNorm (batch-invariant, its smoke's default): the block tables,
# pool and runner are L13's, and tests/test_l14_invariance.py sweeps what the mode adds (slices of every size, batch
# sizes 1 to 17, prefixes up to 4,000 tokens) far past three block sizes; its 4 cells judge parity and the seven
# invariance checks in each dtype and prompt set.
SWEPT_BY_TESTS = {"L11": "tests/test_l11_invariants.py", "L12": "tests/test_l11_invariants.py",
                  "L13": "tests/test_l11_invariants.py", "L14": "tests/test_l14_invariance.py"}
# L15 runs L14's engine twice, as P and D, with the prompt's full blocks moved between them: the block tables, pool
# and runner are L14's; a block size changes only how many blocks travel and how many tokens D recomputes, which
# tests/test_l15_transfer.py checks at block size 4 and its 4 cells at 16 (in each, D's tokens against HF's).
# L16 runs L15's engine (L14's tables, pool and runner) on a model whose matrices are weight blocks: a block size
# changes nothing the blocks touch, so its cells run at the largest one, and in fp32 only (FP32_ONLY).
LARGEST_BLOCK_ONLY = L8_BLOCK_TABLES | set(SWEPT_BY_TESTS) | {"L15", "L16"}
# Lessons that compute in fp32 only: L16's blocks multiply fp32 activations (its smoke refuses --dtype bfloat16).
# Their rows have no cell in another dtype.
FP32_ONLY = {"L16"}
# A lesson's own options in every cell of its row. L11: the target drafting for itself, so every decode is a
# verify row of up to K drafts that cross block boundaries and roll back, in each dtype (the n-gram drafter of
# its no-argument run drafts once on the random-weight model, which .ci/run has just run).
# Its cells are then no cell of a no-argument run, so --skip-no-arg-runs leaves none of them out.
# L16: Q4_1 with --parity, so each cell is exact: on the embedded model, quantized here, HF runs the dequantized
# weights (a checkpoint the smoke writes once into the course cache, lessons/l16_weight_quant/reference.py); on
# smollm2 the shipped Q4_1 file against its converted checkpoint, which is that file dequantized. Either way the
# cell judges L16's engine (and L15's on the dequantized model) against HF's tokens, and the logits at every output
# position bitwise the dequantized model's (its extra check). Its no-argument run (the quality contract) .ci/run makes.
LESSON_OPTIONS = {"L11": ("--drafter", "draft"), "L12": ("--kv-dtype", "auto"), "L16": ("--weights", "q4_1", "--parity")}
# Cells whose every engine run another row's cell makes again, in the same dtype, prompts and block size, so
# --skip-repeated-runs (.ci/run) leaves them out. A smoke runs its lesson's engine and the one before it
# (shared/smoke.py: build_engines), so the row after a lesson runs that lesson's engine too: with the unicode
# set's one prompt (no crowd, nothing to share, no preemption) L3's row runs L2Engine exactly as L2's row does,
# and L2's other engine, L1, is L1's row; likewise L4 in L5's row (L3 in L3's) and L6 in L7's row (L5 in L5's).
# Rows left whole (L1, L3, L5, L7) hold the engines before the ones cut, so no engine loses a cell. Of the lesson
# checks beyond parity, only L6's (no block leaked) runs in a cut cell; its default cells run it at every block
# size, with a crowd. The default prompts are each smoke's own, so no default cell repeats another, except L1's:
# L2's default prompt is L1's, and L2's row runs L1Engine on it.
# lesson -> (prompt set, its dtypes or None for all, the row that runs its engines again).
REPEATED_IN = {
    "L1": ("default", ("bfloat16", "float16"), "L2"),  # fp32 default is the no-argument run
    "L2": ("unicode", None, "L3"),
    "L4": ("unicode", None, "L5"),
    "L6": ("unicode", None, "L7"),
}


def grid(smokes: dict[Path, bool], dtypes: list[str], prompt_sets: list[str], block_sizes: list[int],
         model: str | None = None, tp: int | None = None) -> list[Cell]:
    """smokes: script -> whether it takes --block-size. `tp`: L10's ranks (a model whose heads 2 do not divide)."""
    cells = []
    for script, blocks in smokes.items():
        lesson = "L" + SMOKE.match(script.name).group(1)
        sizes = [max(block_sizes)] if lesson in LARGEST_BLOCK_ONLY else block_sizes
        options = LESSON_OPTIONS.get(lesson, ()) + (("--tp", str(tp)) if tp and lesson == "L10" else ())
        for prompts in prompt_sets:
            for dtype in [d for d in dtypes if d == "float32"] if lesson in FP32_ONLY else dtypes:
                for size in sizes if blocks else [None]:
                    cells.append(Cell(lesson, script, dtype, prompts, size, options, model))
    return cells


def chat_prompts(model: str | None) -> list[str]:
    """CHAT_QUESTIONS, each as a one-message conversation in the checkpoint's own chat template, ready to answer."""
    from transformers import AutoTokenizer

    from shared.cli import resolve_model_dir
    from shared.tiny_qwen3 import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(model, default_model_dir)))
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in CHAT_QUESTIONS]


def repeated(cells: list[Cell]) -> dict[Cell, Cell]:
    """Each cell of `cells` that REPEATED_IN names -> the cell of the row that runs its engines again (same dtype
    and prompts; the same block size, or any for a lesson without blocks), where that row is among `cells`."""
    out = {}
    for cell in cells:
        if cell.lesson not in REPEATED_IN:
            continue
        prompts, dtypes, by = REPEATED_IN[cell.lesson]
        if cell.prompts != prompts or (dtypes is not None and cell.dtype not in dtypes):
            continue
        for other in cells:
            if (other.lesson == by and other.dtype == cell.dtype and other.prompts == cell.prompts
                    and (cell.block_size is None or other.block_size == cell.block_size)):
                out[cell] = other
                break
    return out


def classify(returncode: int | None, stdout: str, stderr: str) -> Outcome:
    """Judge one smoke run by the contract: exit 0 match (ties allowed), 1 mismatch, 2 bad input.

    A crash also exits 1, so exit 1 counts as FAIL only when the smoke printed its JSON verdict.
    """
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if returncode is None:
        return Outcome("ERROR", "timed out")
    try:
        result = json.loads(stdout.strip().splitlines()[-1])
        prompts = result["prompts"]
    except (IndexError, ValueError, KeyError, TypeError):
        return Outcome("ERROR", f"exit {returncode}, no JSON verdict" + (f": {last}" if last else ""))
    if returncode not in (0, 1):
        return Outcome("ERROR", f"exit {returncode}" + (f": {last}" if last else ""))
    mismatches, ties, partial, judged, tokens = [], [], [], 0, 0
    for i, entry in enumerate(prompts):
        for key, verdict in entry.items():
            if not key.endswith("_verdict"):
                continue
            name = key.removesuffix("_verdict")
            judged, tokens = judged + verdict.get("judged", 0), tokens + len(entry.get(name, []))
            if verdict["status"] != "mismatch" and verdict.get("judged", 0) != len(entry.get(name, [])):
                partial.append(f"prompt {i} {name}: {verdict.get('judged', 0)} of {len(entry.get(name, []))} judged")
            if verdict["status"] == "match":
                continue
            where = (f"prompt {i} {name} at position {verdict['position']}: "
                     f"ours {verdict['ours']}, HF {verdict['theirs']}, margin {verdict['margin']}")
            if verdict.get("fp32_pick") is not None:
                where += f", HF in fp32 picks {verdict['fp32_pick']}"
            if len(verdict.get("ties", [])) > 1 or (verdict["status"] == "mismatch" and verdict.get("ties")):
                where += f" (ties at {', '.join(map(str, verdict['ties']))})"
            (ties if verdict["status"] == "tie" else mismatches).append(where)
    extra = result.get("extra_check")
    if extra is not None and not extra.get("ok"):
        mismatches.append(f"extra check: {extra.get('message')}")
    if mismatches or returncode == 1 or not result.get("match", False):
        return Outcome("FAIL", "; ".join(mismatches) or f"exit {returncode} with every verdict a match", judged, tokens)
    if partial:  # a pass that left tokens unjudged is no verdict on them
        return Outcome("ERROR", "not every position judged: " + "; ".join(partial), judged, tokens)
    if ties:
        return Outcome("TIE", "numerical tie: " + "; ".join(ties), judged, tokens)
    return Outcome("PASS", "", judged, tokens)


def run_cell(cell: Cell, max_new_tokens: int, device: str | None, timeout: float) -> tuple[Outcome, float]:
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cell.argv(max_new_tokens, device), capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                           env={**os.environ, "HF_HUB_OFFLINE": "1"})
        outcome = classify(r.returncode, r.stdout, r.stderr)
    except subprocess.TimeoutExpired:
        outcome = classify(None, "", "")
    return outcome, time.perf_counter() - t0


def column(cell: Cell, block_sizes: list[int]) -> str:
    size = block_sizes[0] if cell.block_size is None else cell.block_size
    return f"{SHORT.get(cell.dtype, cell.dtype)} S={size}"


def render(console: Console, cells: list[Cell], outcomes: dict[Cell, Outcome], args,
           skipped: frozenset[Cell] = frozenset(), repeats: dict[Cell, Cell] | None = None) -> None:
    repeats = repeats or {}
    for prompts in args.prompt_sets:
        title = {"default": "default prompts", "unicode": f"unicode prompt ({len(UNICODE_PROMPT)} characters)",
                 "chat": f"chat prompts ({len(CHAT_QUESTIONS)} questions in the checkpoint's chat template)"}[prompts]
        title += "" if args.model is None else f" · --model {args.model}"
        table = Table(title=title, title_justify="left")
        columns = [f"{SHORT.get(d, d)} S={s}" for d in args.dtypes for s in args.block_sizes]
        table.add_column("lesson")
        for name in columns:
            table.add_column(name, justify="center")
        for lesson in dict.fromkeys(c.lesson for c in cells):
            mine = [c for c in cells if c.lesson == lesson and c.prompts == prompts]
            row = {column(c, args.block_sizes): "no-arg" if c in skipped else f"in {repeats[c].lesson}" if c in repeats
                   else outcomes[c].status for c in mine}
            table.add_row(lesson, *(f"[{STYLE.get(row[n], 'dim')}]{row[n]}[/]" if n in row else "[dim]—[/]"
                                    for n in columns))
        console.print(table)
    if any(c.lesson in L8_BLOCK_TABLES for c in cells) and len(args.block_sizes) > 1:
        console.print(f"[dim]{', '.join(sorted(L8_BLOCK_TABLES & {c.lesson for c in cells}))} run L8's block tables "
                      f"(swept in L8's row) and ran at the largest block size only.[/]", soft_wrap=True)
    for lesson in sorted({c.lesson for c in cells} & set(SWEPT_BY_TESTS), key=lambda name: int(name[1:])):
        if len(args.block_sizes) > 1:
            console.print(f"[dim]{lesson} ran at the largest block size only: {SWEPT_BY_TESTS[lesson]} sweeps its "
                          f"block sizes.[/]", soft_wrap=True)
    for lesson in sorted({c.lesson for c in cells} & FP32_ONLY, key=lambda name: int(name[1:])):
        if len(args.dtypes) > 1:
            console.print(f"[dim]{lesson} computes in fp32 only: its cells in other dtypes are not run.[/]",
                          soft_wrap=True)
    for lesson, options in sorted({(c.lesson, c.options) for c in cells if c.options}, key=lambda x: int(x[0][1:])):
        console.print(f"[dim]{lesson} ran with {' '.join(options)} in every cell.[/]", soft_wrap=True)
    if any(c.block_size is None for c in cells):
        console.print("[dim]—: the lesson has no blocks; it ran once per dtype and prompt set, shown under the first "
                      "block size.[/]", soft_wrap=True)
    if skipped:
        console.print("[dim]no-arg: the run the smoke makes with no arguments (.ci/run makes it just before, as a user "
                      "does, and stops on a non-zero exit), not run again here.[/]", soft_wrap=True)
    for lesson in sorted({c.lesson for c in repeats}, key=lambda name: int(name[1:])):
        by = sorted({r.lesson for c, r in repeats.items() if c.lesson == lesson})
        console.print(f"[dim]in {', '.join(by)}: {lesson}'s engines ran there again in the same dtype, prompts and block "
                      f"size (the row after a lesson runs its engine), not run twice here.[/]", soft_wrap=True)
    console.print("[dim]TIE: only half-precision numerical ties, as the parity rule allows, every later position judged "
                  "on our own tokens.[/]", soft_wrap=True)
    for c in cells:
        if c not in skipped and c not in repeats and outcomes[c].status != "PASS":
            where = f"{c.lesson} {c.dtype} {c.prompts}" + ("" if c.block_size is None else f" S={c.block_size}")
            console.print(f"[{STYLE[outcomes[c].status]}]{outcomes[c].status}[/] {where}: {outcomes[c].note}",
                          soft_wrap=True, highlight=False)


def summary(outcomes: list[Outcome], seconds: float) -> str:
    """The last line: runs per status, and how many generated tokens the parity rule judged (all, when it passes)."""
    judged, tokens = sum(o.judged for o in outcomes), sum(o.tokens for o in outcomes)
    return (f"{len(outcomes)} smoke runs in {seconds:.0f} s: "
            + ", ".join(f"{sum(o.status == s for o in outcomes)} {s}" for s in STYLE)
            + f"; positions judged: {judged} of {tokens} generated tokens")


def _list(kind, allowed: set[str] | None = None):
    def parse(text: str):
        items = [kind(x) for x in text.split(",") if x.strip()]
        if not items:
            raise ValueError("empty")
        if allowed is not None and not set(items) <= allowed:
            raise ValueError(f"not in {sorted(allowed)}")
        return items
    parse.__name__ = "comma-separated list"  # argparse names the type in its error line
    return parse


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="parity_matrix.py", description=__doc__.splitlines()[0])
    p.add_argument("--lessons", type=_list(str.upper), help="comma-separated, e.g. l2,l5 (default: every smoke)")
    p.add_argument("--block-sizes", type=_list(int), default=[1, 7, 16], help="default 1,7,16")
    p.add_argument("--dtypes", type=_list(str, set(DTYPES)), default=["float32", "bfloat16"],
                   help="default float32,bfloat16")
    p.add_argument("--prompt-sets", type=_list(str, set(PROMPT_SETS)), default=DEFAULT_PROMPT_SETS,
                   help=f"of {','.join(PROMPT_SETS)} (default {','.join(DEFAULT_PROMPT_SETS)})")
    p.add_argument("--max-new-tokens", type=int, default=20, help="per smoke run (default 20, the smokes' own)")
    p.add_argument("--model", help="passed to every smoke: a checkpoint directory or a named model, e.g. smollm2 "
                                   "(default: the smokes' own, the embedded model)")
    p.add_argument("--tp", type=int, help="L10's ranks (default: its smoke's own: 2, or 3 for smollm2's 9 heads)")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], help="passed to every smoke (default: theirs, auto)")
    p.add_argument("--jobs", type=int, default=1, help="smokes run at once (default 1: each uses a core)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per smoke run (default 600)")
    p.add_argument("--skip-no-arg-runs", action="store_true",
                   help="leave out each smoke's no-argument cell (default prompts and block size, float32 on the CPU), "
                        "for a caller that has just run every smoke with no arguments and checked its exit status "
                        "(.ci/run); only with the default --max-new-tokens and --device")
    p.add_argument("--skip-repeated-runs", action="store_true",
                   help="leave out the cells whose engines another row's cell runs again in the same dtype, prompts and "
                        "block size (REPEATED_IN: the row after a lesson runs that lesson's engine), where that row runs")
    args = p.parse_args(argv)
    for name, value in (("--jobs", args.jobs), ("--max-new-tokens", args.max_new_tokens), ("--timeout", args.timeout),
                        ("--tp", args.tp or 1), *(("--block-sizes", s) for s in args.block_sizes)):
        if value < 1:
            p.error(f"{name} must be at least 1, got {value:g}")
    scripts = discover(ROOT / "scripts")
    if args.skip_no_arg_runs and (args.max_new_tokens != 20 or args.device not in (None, "auto") or args.model):
        p.error("--skip-no-arg-runs: a no-argument run uses the default --max-new-tokens, --device and --model")
    if args.lessons:
        unknown = set(args.lessons) - {"L" + SMOKE.match(s.name).group(1) for s in scripts}
        if unknown:
            p.error(f"--lessons: no smoke script for {', '.join(sorted(unknown))}")
        scripts = [s for s in scripts if "L" + SMOKE.match(s.name).group(1) in args.lessons]

    console, progress = Console(), Console(stderr=True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        helps = pool.map(lambda s: subprocess.run([sys.executable, str(s), "--help"], capture_output=True, text=True,
                                                  cwd=ROOT).stdout, scripts)
        helps = dict(zip(scripts, helps))
        if "chat" in args.prompt_sets:
            try:
                PROMPT_SETS["chat"] = chat_prompts(args.model)
            except CourseError as e:  # a model that cannot be found or made: one line, as a smoke would say it
                p.error(f"--model {args.model}: {e}")
        cells = grid({s: has_blocks(h) for s, h in helps.items()}, args.dtypes, args.prompt_sets, args.block_sizes,
                     args.model, args.tp)
        skipped: frozenset[Cell] = frozenset()
        if args.skip_no_arg_runs:
            import torch

            skipped = frozenset(no_arg_cell(s, h, torch.cuda.is_available()) for s, h in helps.items()) & set(cells)
        repeats = repeated(cells) if args.skip_repeated_runs else {}
        to_run = [c for c in cells if c not in skipped and c not in repeats]
        outcomes: dict[Cell, Outcome] = {}

        def run(cell: Cell) -> None:
            outcomes[cell], seconds = run_cell(cell, args.max_new_tokens, args.device, args.timeout)
            progress.print(f"[{len(outcomes)}/{len(to_run)}] {cell.lesson} {cell.dtype} {cell.prompts} "
                           f"S={cell.block_size or '-'}: {outcomes[cell].status} ({seconds:.1f} s)", highlight=False)

        list(pool.map(run, to_run))
    render(console, cells, outcomes, args, skipped, repeats)
    bad = sum(o.status in ("FAIL", "ERROR") for o in outcomes.values())
    console.print(summary(list(outcomes.values()), time.perf_counter() - t0), highlight=False, soft_wrap=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
