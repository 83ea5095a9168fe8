"""The harness behind every scripts/lN_smoke.py: run the lesson and its predecessors, check each against HF.

A lesson script supplies only `build_engines(model, args)`: an ordered mapping from a lesson name to a
function that turns a list of prompts (token IDs) into a list of outputs. The first entry is the
lesson under test; the others are the earlier lessons it must agree with.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NoReturn

import torch
from rich.console import Console
from rich.table import Table
from tokenizers import Tokenizer

from shared.checkpoint import tensor_shapes
from shared.cli import resolve_device, resolve_dtype, resolve_model_dir
from shared.config import Qwen3Config
from shared.errors import CourseError, RunFailure
from shared.generation import StopRule, check_prompt
from shared.hf_reference import NEAR, HfOutput, HfReference
from shared.model import Qwen3ForCausalLM
from shared.parity import Verdict, compare
from shared.pool_trace import record_engines
from shared.tiny_qwen3 import default_model_dir
from shared.tokenizer import load_tokenizer

WORKSPACE_STATE = ".course.json"  # what scripts/build_track/workspace.py writes at a workspace's root
RunPrompts = Callable[[list[list[int]], StopRule], list[list[int]]]
BuildEngines = Callable[[Qwen3ForCausalLM, argparse.Namespace], dict[str, RunPrompts]]
# A lesson's own check beyond greedy parity (L4: seeded sampling alone vs in a crowd): (passed, one line).
ExtraCheck = Callable[[Qwen3ForCausalLM, "Setup", argparse.Namespace], "tuple[bool, str] | None"]


@dataclass
class Setup:
    model_dir: Path
    device: torch.device
    dtype: torch.dtype
    config: Qwen3Config
    tokenizer: Tokenizer
    prompts: list[str]
    prompt_ids: list[list[int]]
    stop: StopRule


def lessons_line() -> str | None:
    """In a `course.py start` workspace, one line naming the lessons/ this run imports; None in the course itself,
    whose output stays as the docs show it. (A workspace's scripts put their own tree first on sys.path; before
    they did, the editable install's lessons/ ran, and a smoke passed with every task stubbed.)"""
    lessons = sys.modules.get("lessons")  # the smoke imported its lessons already; shared/ imports none itself
    if lessons is None or not getattr(lessons, "__file__", None):
        return None
    tree = Path(lessons.__file__).resolve().parents[1]
    script = Path(sys.argv[0]).resolve().parent.parent if sys.argv and sys.argv[0] else tree  # scripts/lN_smoke.py
    if not (tree / WORKSPACE_STATE).exists():
        if not (script / WORKSPACE_STATE).exists():
            return None
        return f"lessons from {tree / 'lessons'}: not this workspace's ({script}), so its own code did not run"
    # The editable install still answers for a lesson the workspace lacks (a later lesson's script run here).
    elsewhere = sorted({Path(m.__file__).resolve().parent for name, m in list(sys.modules.items())
                        if name.startswith("lessons.") and name.count(".") == 1 and getattr(m, "__file__", None)
                        and tree not in Path(m.__file__).resolve().parents})
    return f"lessons from {tree / 'lessons'}" + "".join(f"; {p.name} from {p.parent}, not this workspace"
                                                         for p in elsewhere)


def prepare(args: argparse.Namespace, status: Console) -> Setup:
    """Everything that can be checked before a model is loaded, so bad input fails fast."""
    if line := lessons_line():  # on stderr: --json's stdout stays one JSON object
        status.print(line, soft_wrap=True, markup=False, highlight=False)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    with status.status("building the embedded tiny Qwen3 (first run only)..."):
        model_dir = resolve_model_dir(args.model, default_model_dir)
    config = Qwen3Config.from_dir(model_dir)
    tensor_shapes(model_dir)  # missing or corrupt weight files fail here, from their headers, before loading
    eos = frozenset(config.eos_token_ids)
    stop = StopRule(args.max_new_tokens, eos, args.ignore_eos)
    prompts = args.prompt if args.prompt is not None else args.prompt_defaults
    tokenizer = load_tokenizer(model_dir)
    prompt_ids = []
    for text in prompts:
        if not text:
            raise CourseError("empty prompt: --prompt needs some text")
        ids = tokenizer.encode(text).ids
        check_prompt(ids, stop, config)
        prompt_ids.append(ids)
    return Setup(model_dir, device, dtype, config, tokenizer, prompts, prompt_ids, stop)


def lesson_engine(lesson: str) -> type:
    """L6 -> lessons.l6_prefix_sharing.L6Engine: the class a smoke's --trace records."""
    import importlib

    package = next(p.name for p in (Path(__file__).resolve().parent.parent / "lessons").iterdir()
                   if p.name.startswith(lesson.lower() + "_"))
    return getattr(importlib.import_module(f"lessons.{package}"), f"{lesson}Engine")


def run_smoke(lesson: str, args: argparse.Namespace, build_engines: BuildEngines, extra_check: ExtraCheck | None = None) -> int:
    console = Console(stderr=args.json)
    setup = prepare(args, Console(stderr=True))
    outputs: dict[str, list[list[int]]] = {}
    seconds: dict[str, float] = {}

    def timed(name: str, run: RunPrompts) -> None:
        t0 = time.perf_counter()
        outputs[name] = run(setup.prompt_ids, setup.stop)
        seconds[name] = time.perf_counter() - t0

    # --trace: the lesson's own engine records (the last that ran, if the script builds several), in its run only
    trace = getattr(args, "trace", None)
    with record_engines(lesson_engine(lesson), trace, lesson.lower()) if trace else nullcontext():
        with console.status("loading weights...") if not args.json else nullcontext():
            model = Qwen3ForCausalLM.from_dir(setup.model_dir, setup.dtype, setup.device)
            engines = build_engines(model, args)  # lesson-specific checks (block size, pool) raise here
        timed(*next(iter(engines.items())))  # the lesson under test comes first
    for name, run in list(engines.items())[1:]:
        timed(name, run)
    hf = HfReference(setup.model_dir, setup.dtype, setup.device)
    t0 = time.perf_counter()
    hf_out = [hf.generate(ids, setup.stop) for ids in setup.prompt_ids]
    seconds["HF"] = time.perf_counter() - t0
    # After a half-precision tie, `hf` scores our own tokens (teacher-forced) so every later position is judged too.
    verdicts = {name: [compare(o, h, setup.dtype, setup.stop, ids, hf) for o, h, ids in zip(outs, hf_out, setup.prompt_ids)]
                for name, outs in outputs.items()}
    ok = all(v.ok for vs in verdicts.values() for v in vs)
    extra = extra_check(model, setup, args) if extra_check else None  # None: the check does not apply
    if args.json:
        result = _as_json(lesson, setup, outputs, hf_out, verdicts, seconds, ok)
        if extra is not None:
            result["extra_check"] = {"ok": extra[0], "message": extra[1]}
        print(json.dumps(result))
    else:
        _report(console, lesson, setup, outputs, hf_out, verdicts, seconds, ok)
        if extra is not None:
            console.print(("[bold green]PASS[/]: " if extra[0] else "[bold red]FAIL[/]: ") + extra[1], soft_wrap=True)
    return 0 if ok and (extra is None or extra[0]) else 1


def main(lesson: str, parser: argparse.ArgumentParser, build_engines: BuildEngines,
         extra_check: ExtraCheck | None = None) -> None:
    """Parse, run, and turn every CourseError into one line on stderr with exit status 2 (a RunFailure: 1)."""
    args = parser.parse_args()
    exit_with(lambda: run_smoke(lesson, args, build_engines, extra_check))


def exit_with(run: Callable[[], int]) -> NoReturn:
    """Exit with run()'s status; a CourseError is one line on stderr and exit 2, a RunFailure exit 1."""
    try:
        code = run()
    except CourseError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except RunFailure as e:  # the run broke (a tensor-parallel rank died), not its input
        print(f"error: {e}", file=sys.stderr)
        code = 1
    raise SystemExit(code)


def _as_json(lesson, setup: Setup, outputs, hf_out: list[HfOutput], verdicts, seconds, ok) -> dict:
    prompts = []
    for i, text in enumerate(setup.prompts):
        entry = {"prompt": text, "prompt_ids": setup.prompt_ids[i], "hf": hf_out[i].tokens}
        for name in outputs:
            entry[name] = outputs[name][i]
            entry[f"{name}_verdict"] = verdicts[name][i].to_json()
        entry["match"] = all(verdicts[name][i].ok for name in outputs)
        prompts.append(entry)
    return {
        "lesson": lesson,
        "model": str(setup.model_dir),
        "device": str(setup.device),
        "dtype": str(setup.dtype).removeprefix("torch."),
        "max_new_tokens": setup.stop.max_new_tokens,
        "ignore_eos": setup.stop.ignore_eos,
        "prompts": prompts,
        "seconds": {k: round(v, 4) for k, v in seconds.items()},
        "match": ok,
    }


def _report(console: Console, lesson, setup: Setup, outputs, hf_out: list[HfOutput], verdicts, seconds, ok) -> None:
    names = list(outputs)
    console.print(
        f"[bold]{lesson} smoke[/] · model {setup.model_dir} · {setup.device} {str(setup.dtype).removeprefix('torch.')}"
        f" · max-new-tokens {setup.stop.max_new_tokens}{' · ignore-eos' if setup.stop.ignore_eos else ''}"
    )
    for i, text in enumerate(setup.prompts):
        console.rule(f"prompt {i}: {text!r} ({len(setup.prompt_ids[i])} tokens)")
        table = Table(show_edge=False, pad_edge=False)
        table.add_column("pos", justify="right")
        for col in ["HF", *names]:
            table.add_column(col, justify="right")
        hf_tokens = hf_out[i].tokens
        longest = max(len(hf_tokens), *(len(outputs[n][i]) for n in names))
        for pos in range(longest):
            row = [str(pos), _cell(hf_tokens, pos, hf_tokens)]
            row += [_cell(outputs[n][i], pos, hf_tokens) for n in names]
            table.add_row(*row)
        console.print(table)
        console.print(f"text: {setup.tokenizer.decode(outputs[names[0]][i])!r}", soft_wrap=True)
        for n in names:
            # soft_wrap: a result line stays one line in a pipe or a narrow terminal, so grep and the docs see it whole
            console.print(f"{n} vs HF: {_describe(verdicts[n][i], setup.dtype, len(outputs[n][i]))}", soft_wrap=True)
    console.rule("timing")
    for name, s in seconds.items():
        ratio = "" if name == "HF" else f"  ({seconds['HF'] / s:.2f}x HF's speed)" if s > 0 else ""
        console.print(f"{name:>4}: {s:7.3f} s{ratio}")
    console.print("[bold green]PASS[/]: every prompt matches HF" if ok else "[bold red]FAIL[/]: a prompt diverged from HF",
                  soft_wrap=True)


def _cell(tokens: list[int], pos: int, reference: list[int]) -> str:
    if pos >= len(tokens):
        return "-"
    same = pos < len(reference) and reference[pos] == tokens[pos]
    return str(tokens[pos]) if same else f"[bold red]{tokens[pos]}[/]"


def _describe(v: Verdict, dtype: torch.dtype, n_tokens: int) -> str:
    if v.status == "match":
        return "[green]identical[/]"
    margin = "n/a" if v.margin is None else f"{v.margin:.4g}"
    if v.ties and v.position != v.ties[0]:  # a mismatch after a tie: HF scored our own tokens there
        where = f"at position {v.position}, after a numerical tie at {_positions(v.ties)} (HF scoring our own tokens): "
        if v.ours is None:
            return f"[bold red]MISMATCH[/] {where}ours ended with no EOS and before max-new-tokens; HF picks {v.theirs}"
        if v.theirs is None:
            return f"[bold red]MISMATCH[/] {where}ours {v.ours} after our own stop rule ended the output (EOS or max-new-tokens)"
        where += f"ours {v.ours}, HF {v.theirs}, HF top-2 margin {margin}"
    else:
        where = f"first divergence at position {v.position}: ours {v.ours}, HF {v.theirs}, HF top-2 margin {margin}"
    if v.status == "tie":
        judged = (f"; {v.judged} of {n_tokens} positions judged (after the first tie on our own tokens), "
                  f"ties at {_positions(v.ties)}")
        if v.fp32_pick is not None:
            return (f"[yellow]numerical tie[/] ({where}; HF run in fp32 on the same tokens picks ours, {v.fp32_pick}: "
                    f"HF's {dtype} rounding moved its argmax, not a failure){judged}")
        return (f"[yellow]numerical tie[/] ({where}; in HF's run ours is {v.gap:.4g} below the top logit, within the "
                f"tolerance {v.tolerance:.3g} for {dtype}: not a failure){judged}")
    if v.fp32_pick is not None:
        where += f" (HF in fp32 picks {v.fp32_pick})"
    if v.gap is None and v.ours is not None and v.theirs is not None:
        where += f" (ours is not among HF's {NEAR} best tokens there)"
    elif v.gap is not None:
        where += f" (in HF's run ours is {v.gap:.4g} below the top logit; the tolerance is {v.tolerance:.3g})"
    return f"[bold red]MISMATCH[/] {where}"


def _positions(positions: tuple[int, ...]) -> str:
    return ", ".join(map(str, positions))
