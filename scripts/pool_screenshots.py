"""The pool viewer's screenshots in the lesson docs, made by one command from real runs of the embedded model:

    python scripts/pool_screenshots.py [--out docs/figures/pool]

Each lesson's run is scripts/pool_viewer.py's workload; the frame shown is the first where the moment happens
(found in the replay's words), with the request it happens to selected. Needs the browser extra and Debian's
Chromium: pip install -e ".[browser]"; apt-get install chromium chromium-driver.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from pool_viewer import build, run, token_pieces, workload  # noqa: E402
from shared.cli import OneLineParser  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.pool_page import page_data, render  # noqa: E402
from shared.pool_trace import read_trace, record_engine  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

# file name: (lesson, policy, the words that mark the moment, what the doc's caption says, pool blocks)
MOMENTS = {
    "l4_join.png": ("l4", "recompute", "prefills tokens 0", "a request joins while the others decode", 20),
    "l5_swap.png": ("l5", "swap", "swap out", "a preemption: the newest request's blocks copied to host memory", 18),
    "l6_hit.png": ("l6", "recompute", "prefix-cache hit", "a prefix-cache hit: the shared system prompt's blocks", 20),
    "l6_cow.png": ("l6", "recompute", "copy-on-write", "a fork's copy-on-write", 20),
    "l8_slices.png": ("l8", "recompute", "prefills tokens", "a prompt cut into a slice beside the decodes", 20),
    "l11_rollback.png": ("l11", "recompute", "rejected rolled back", "speculative decoding: rejected drafts rolled back",
                         20),
}


def moment(data: dict, marker: str, lesson: str) -> tuple[int, str | None]:
    """The first frame whose words hold `marker` (L4: one that also decodes; L8: one that decodes and feeds a
    prompt only part of the way), and the request it names."""
    for i, f in enumerate(data["frames"]):
        cut = [p for p in f["plan"] if not p["decode"] and p["to"] < data["seqs"][str(p["seq"])]["prompt"]]
        for w in f["words"]:
            if marker in w:
                decodes = any(p["decode"] for p in f["plan"])
                if lesson == "l4" and not decodes or lesson == "l8" and not (cut and decodes):
                    continue
                if lesson == "l8":
                    return i, str(cut[0]["seq"])
                seq = w.split()[1] if w.startswith("request ") else None
                if marker == "copy-on-write":
                    seq = next((s for s, t in f["tables"].items() if f["touched"]["cow"][0] in t), None)
                return i, seq
    raise SystemExit(f"error: no frame of {lesson}'s run shows {marker!r}")


def main() -> None:
    p = OneLineParser(prog="pool_screenshots.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/figures/pool", help="folder for the PNGs (default: docs/figures/pool)")
    args = p.parse_args()
    from selenium import webdriver  # the browser extra

    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        p.error("Chromium or chromedriver is absent: apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900", "--hide-scrollbars"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=driver_path), options=options)
    model = Qwen3ForCausalLM.from_dir(default_model_dir(), torch.float32, torch.device("cpu"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, (lesson, policy, marker, caption, blocks) in MOMENTS.items():
                run_args = argparse.Namespace(block_size=4, num_blocks=blocks, requests=6, stagger=2, seed=0,
                                              policy=policy)
                engine = build(lesson, model, run_args)
                trace_path = Path(tmp) / f"{name}.jsonl"
                with record_engine(engine, trace_path, lesson):
                    run(engine, lesson, workload(model.config.vocab_size, run_args), run_args)
                trace = read_trace(trace_path)
                data = page_data(trace, title=f"{lesson.upper()}: {caption}", pieces=token_pieces(trace, default_model_dir()))
                page = Path(tmp) / f"{name}.html"
                page.write_text(render(data))
                at, seq = moment(data, marker, lesson)
                driver.get(page.as_uri() + f"#frame={at}" + (f"&select={seq}" if seq is not None else ""))
                driver.save_screenshot(str(out / name))
                print(f"{out / name}: {lesson} frame {at} ({caption})")
    finally:
        driver.quit()


if __name__ == "__main__":
    main()
