"""The pool viewer's page in a real browser (headless Chromium through Selenium and Debian's chromedriver): for every
lesson whose run has blocks, the page opened from a file shows, at chosen steps, each request's block table and
the grid's owners exactly as the replay has them; the console stays clean; play, pause, the slider, the keys,
a click on a request and a hover work; L15's page shows P's and D's pools side by side, stepping together in wall
order, each pane as its replay has it (leases and pulls included). Skipped, with one line, where Chromium,
chromedriver or Selenium is absent (CI installs them: `apt-get install chromium chromium-driver`,
`pip install -e ".[browser]"`)."""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from pool_viewer import LESSONS, PAIRED, build, run, token_pieces, workload  # noqa: E402
from shared.pool_page import page_data, render  # noqa: E402
from shared.pool_replay import replay  # noqa: E402
from shared.pool_trace import PoolRecorder, read_trace  # noqa: E402
from test_pool_trace import CheckedTrace, all_returned  # noqa: E402

webdriver = pytest.importorskip("selenium.webdriver", reason="Selenium is not installed: pip install -e '.[browser]'")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
SINGLE = tuple(lesson for lesson in LESSONS if lesson not in PAIRED)  # one engine, one pool: the fixture's runs
if CHROMIUM is None or DRIVER is None:
    pytest.skip("Chromium or chromedriver is absent: apt-get install chromium chromium-driver", allow_module_level=True)


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=DRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def pages(tmp_path_factory, tiny_model, tiny_dir):
    """Every lesson's run on the embedded model, recorded (each record checked against the engine): {lesson: (page
    path, trace)}."""
    out = tmp_path_factory.mktemp("pages")
    args = argparse.Namespace(block_size=4, num_blocks=24, requests=5, stagger=1, seed=2, policy="recompute")
    made = {}
    for lesson in SINGLE:
        engine = build(lesson, tiny_model, args)
        checked = CheckedTrace(engine)  # and the replay equals the engine after every record, as in test_pool_trace
        recorder = PoolRecorder(engine, checked, lesson)
        run(engine, lesson, workload(tiny_model.config.vocab_size, args), args)
        recorder.close()
        assert all_returned(engine) and checked.records > 5
        trace = [json.loads(line) for line in checked.getvalue().splitlines()]
        html = out / f"{lesson}.html"
        html.write_text(render(page_data(trace, pieces=token_pieces(trace, tiny_dir))))
        made[lesson] = (html, trace)
    return made


def errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]


def load(driver, url: str) -> None:
    """Open `url` with the console log emptied: what a test reads is this page's (a live page left behind keeps
    polling its stopped server, and Chromium logs each refused fetch)."""
    driver.get("about:blank")
    driver.get_log("browser")
    driver.get(url)


def shown(driver) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """What the page shows now: each request row's table, and each held block's owners in the grid."""
    tables = driver.execute_script("""
        const out = {};
        for (const row of document.querySelectorAll('#tables .table-row')) {
          out[row.dataset.seq] = [...row.querySelectorAll('.entry[data-block]')].map(e => +e.dataset.block);
        }
        return out;""")
    owners = driver.execute_script("""
        const out = {};
        for (const b of document.querySelectorAll('#grid .block')) {
          if (b.dataset.owners) out[b.dataset.block] = b.dataset.owners.split(' ').map(Number);
        }
        return out;""")
    return ({int(k): v for k, v in tables.items() if v}, {int(k): v for k, v in owners.items()})


@pytest.mark.slow  # every lesson's run on the embedded model, then the browser: about a minute
@pytest.mark.parametrize("lesson", SINGLE)
def test_the_page_shows_what_the_replay_rebuilt(lesson, pages, browser):
    html, trace = pages[lesson]
    frames = replay(trace)
    load(browser, html.as_uri())
    assert browser.execute_script("return window.poolViewer.count") == len(frames) + 1
    for at in sorted({1, len(frames) // 3, 2 * len(frames) // 3, len(frames)} - {0}):
        browser.execute_script("window.poolViewer.show(arguments[0])", at)
        _, state, _ = frames[at - 1]
        tables, owners = shown(browser)
        assert tables == state.tables, f"{lesson} frame {at}: the rows' tables differ from the replay's"
        want: dict[int, list[int]] = {}
        for seq, blocks in sorted(state.tables.items()):
            for b in blocks:
                want.setdefault(b, []).append(seq)
        assert owners == {b: sorted(set(s)) for b, s in want.items()}, f"{lesson} frame {at}: the grid's owners"
    assert errors(browser) == []


@pytest.mark.slow  # L15's run (two engines) on the embedded model, then the browser
def test_l15s_page_steps_both_pools_together(browser, tmp_path):
    """pool_viewer.py --lesson l15: two panes, P's and D's pages; the slider above them walks every record of both in
    wall order ("at"), and at each position each pane shows its last record not after it: the rows' tables, the
    grid's owners and the leases and pulls exactly as the replay has them."""
    import subprocess

    page, paths = tmp_path / "l15.html", [tmp_path / "p.jsonl", tmp_path / "d.jsonl"]
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "pool_viewer.py"), "--lesson", "l15", "--out", str(page),
                        "--save-trace", str(paths[0]), "--save-trace", str(paths[1])],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    traces = [read_trace(path) for path in paths]
    states = [[trace[0], *[state for _, state, _ in replay(trace)]] for trace in traces]  # [0]: the header
    order = sorted((record["at"], j, i) for j, trace in enumerate(traces) for i, record in enumerate(trace))
    load(browser, page.as_uri())
    deadline = time.monotonic() + 20
    while not browser.execute_script("return !!(window.poolPanes && window.poolPanes.ready)"):
        assert time.monotonic() < deadline, "the panes never loaded"
        time.sleep(0.2)
    assert browser.execute_script("return window.poolPanes.count") == len(order)
    held = [k for k, (_, j, i) in enumerate(order) if i and states[j][i].holders()]
    assert held, "no record shows a lease or a pull held"
    for k in sorted({1, len(order) // 2, len(order) - 1, *held[:3]}):
        browser.execute_script("window.poolPanes.show(arguments[0])", k)
        want = [max([0] + [i for t, jj, i in order[:k + 1] if jj == j]) for j in range(2)]
        assert browser.execute_script("return window.poolPanes.frames()") == want, f"position {k}"
        for j, frame in enumerate(browser.find_elements(By.TAG_NAME, "iframe")):
            browser.switch_to.frame(frame)
            try:
                tables, owners = shown(browser)
                holders = browser.execute_script("""
                    const out = {};
                    for (const row of document.querySelectorAll('#holders .table-row')) {
                      const blocks = [...row.querySelectorAll('.entry')].map(e => +e.dataset.block);
                      out[row.querySelector('.who').textContent] = blocks;
                    }
                    return out;""")
            finally:
                browser.switch_to.default_content()
            state = states[j][want[j]]
            if want[j] == 0:  # the header: the pool when recording began (empty here)
                assert tables == {} and holders == {}, f"position {k}, pane {j}"
                continue
            assert tables == state.tables and holders == state.holders(), f"position {k}, pane {j}"
            mine: dict[int, list[int]] = {}
            for seq, blocks in sorted(state.tables.items()):
                for b in blocks:
                    mine.setdefault(b, []).append(seq)
            assert owners == {b: sorted(set(s)) for b, s in mine.items()}, f"position {k}, pane {j}: the grid"
    assert errors(browser) == []


@pytest.mark.slow
def test_controls_work(pages, browser):
    html, trace = pages["l6"]
    load(browser, html.as_uri() + "#frame=3")
    frame = lambda: browser.execute_script("return window.poolViewer.frame()")  # noqa: E731
    assert frame() == 3
    slider = browser.find_element(By.ID, "slider")
    slider.send_keys(Keys.ARROW_RIGHT)
    assert frame() == 4 and slider.get_attribute("value") == "4"
    browser.find_element(By.ID, "prev").click()
    assert frame() == 3
    play = browser.find_element(By.ID, "play")
    play.click()
    assert play.text == "Pause"
    time.sleep(1.2)
    play.click()
    assert play.text == "Play" and frame() > 3
    row = browser.find_element(By.CSS_SELECTOR, "#tables .table-row[data-seq]")
    seq = row.get_attribute("data-seq")
    row.click()
    lit = {int(b.get_attribute("data-block")) for b in browser.find_elements(By.CSS_SELECTOR, "#grid .block.highlight")}
    mine = {int(e.get_attribute("data-block")) for e in row.find_elements(By.CSS_SELECTOR, ".entry[data-block]")}
    assert "selected" in row.get_attribute("class") and lit == mine, f"request {seq}'s blocks"
    block = browser.find_element(By.CSS_SELECTOR, f"#grid .block[data-block='{min(mine)}']")
    webdriver.ActionChains(browser).move_to_element(block).perform()
    tip = browser.find_element(By.ID, "tooltip")
    assert tip.is_displayed() and f"{min(mine)}" in tip.text
    assert errors(browser) == []


@pytest.mark.slow  # a server start
def test_the_live_page_follows_a_running_server(browser):
    """serve.py --pool-viewer: /pool draws the running engine's pool from /pool/frames, read-only; a bad `after` is
    an OpenAI-shaped 400; the server still answers and stops cleanly."""
    import httpx
    import openai

    from shared.server_process import ServerProcess

    server = ServerProcess(["--pool-viewer", "--block-size", "4", "--num-blocks", "64"]).start()
    try:
        base = server.url.removesuffix("/v1")
        assert f"the pool, live, at {base}/pool" in server.log_text()
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
        for prompt in ("The capital of France is", "Hello, world!"):
            client.completions.create(model=server.model, prompt=prompt, max_tokens=6, n=2, temperature=0.8, seed=1)
        got = httpx.get(f"{base}/pool/frames", params={"after": -1}, timeout=30).json()
        assert got["frames"] and got["next"] == got["frames"][-1]["index"] + 1
        words = [w for f in got["frames"] for w in f["words"]]
        assert any("forks" in w for w in words) and any("copy-on-write" in w for w in words), words
        bad = httpx.get(f"{base}/pool/frames", params={"after": "x"}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "after"
        load(browser, f"{base}/pool")
        deadline = time.monotonic() + 20
        while browser.execute_script("return window.poolViewer.count") < len(got["frames"]):
            assert time.monotonic() < deadline, "the live page never fetched the frames"
            time.sleep(0.2)
        browser.execute_script("window.poolViewer.show(window.poolViewer.count - 1)")
        tables, _ = shown(browser)
        assert tables == {int(k): v for k, v in got["frames"][-1]["tables"].items() if v}
        assert errors(browser) == []
        again = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=4)
        assert again.choices[0].text is not None
    finally:
        browser.get("about:blank")  # before the server stops: the page would keep polling it
        status = server.stop()
    assert status == 0, server.stderr_tail()


@pytest.mark.slow  # two ranks and HF
def test_l10s_pool_from_its_smokes_trace(browser, tmp_path, tiny_dir):
    """L10 runs over several processes, so pool_viewer.py has no L10 workload of its own: its smoke's --trace
    records rank 0's engine (which holds the whole pool), and the page draws it."""
    import subprocess

    trace_path, page = tmp_path / "l10.jsonl", tmp_path / "l10.html"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "l10_smoke.py"), "--prompt", "The capital of France is",
                        "--prompt", "Hello", "--max-new-tokens", "4", "--trace", str(trace_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "pool_viewer.py"), "--trace", str(trace_path),
                        "--out", str(page)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "L10 pool" in r.stdout, r.stderr
    frames = replay(read_trace(trace_path))
    assert frames[0][0]["plan"] and {p["seq"] for p in frames[0][0]["plan"]} == {0, 1}
    load(browser, page.as_uri())
    browser.execute_script("window.poolViewer.show(1)")
    assert shown(browser)[0] == frames[0][1].tables
    assert errors(browser) == []
