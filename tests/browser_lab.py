"""The student's JupyterLab, in a real browser (`make test-browser`; not collected by `make test`).

Starts JupyterLab the way `make lab` does (the flags come from the Makefile's LAB_ARGS: repository root
served, chapters/ opened, --allow-root as root) on 127.0.0.1 with a token, over a copy of chapters/ and
figures/ (so nothing the browser does can touch the checkout), and drives Debian's chromium headless with
playwright (CHROMIUM = its path). Checks:

* every chapter: every <img> loaded, no 404 in the server log, MathJax rendered with no error, and opening
  it (kernel started) leaves it unmodified: no dirty tab, and saving it writes the same bytes;
* chapter 01: Run All on the untouched chapter runs to the end, each check cell printing one line
  `E1.x not done yet`; then a correct E1.1 typed into its cell and run with its check prints `E1.1 ok`;
  a tqdm.auto progress bar in a new cell draws as a widget, not as stderr text; `!python` in a cell is a
  Python with torch (Lab's PATH as `make lab` sets it); `export_here(globals())` run before saving names the
  unsaved rms_norm, and after Ctrl+S exports it without a word about unsaved edits.
* the serving chapter's server and a browser client: a page served from another origin (another local port)
  streams a chat answer from `python -m nanovllm_ref serve` (the fake engine) with `fetch`, through the CORS
  preflight, and shows it; the same page cannot read a server whose --allowed-origins leaves it out.

Screenshots go to artifacts/browser/ (git-ignored; CI keeps them).
"""
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "artifacts" / "browser"
CHAPTERS = sorted(p.name for p in (REPO / "chapters").glob("[0-9][0-9]_*.ipynb"))
LAB_ARGS = os.environ.get("LAB_ARGS", f"--ServerApp.root_dir={REPO} --LabApp.default_url=/lab/tree/chapters"
                          + (" --allow-root" if os.geteuid() == 0 else ""))
# `make lab` puts the venv's bin/ first on Lab's PATH (the Makefile's LAB_PATH), so `!python` in a notebook is the
# kernel's Python
LAB_PATH = os.environ.get("LAB_PATH", str(Path(sys.executable).parent))
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
E11 = '''def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x (last dim), scaled by weight. Same shape and dtype as x."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return y.to(x.dtype) * weight'''

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium (make test-browser installs it)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """(base url, token, server log path, copy of the repository) of a JupyterLab started like `make lab`:
    the same flags, its root_dir mapped to the same place in the copy."""
    copy = tmp_path_factory.mktemp("lab")
    shutil.copytree(REPO / "chapters", copy / "chapters", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    shutil.copytree(REPO / "figures", copy / "figures")
    args = shlex.split(LAB_ARGS)
    roots = [a.split("=", 1)[1] for a in args if a.startswith("--ServerApp.root_dir=")]
    served = Path(roots[-1]).resolve() if roots else REPO
    root = copy / served.relative_to(REPO)
    args = [a for a in args if not a.startswith("--ServerApp.root_dir=")]
    port, token = _free_port(), secrets.token_hex(16)
    log = copy.parent / f"{copy.name}-server.log"
    cmd = [str(Path(sys.executable).parent / "jupyter"), "lab", *args, f"--ServerApp.root_dir={root}",
           "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           f"--IdentityProvider.token={token}", "--ServerApp.port_retries=0"]
    env = dict(os.environ, PATH=LAB_PATH + os.pathsep + os.environ.get("PATH", ""))
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=root, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            if proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        yield base, token, log, copy, root
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield b
        b.close()


def open_chapter(browser, lab, name):
    base, token, _, copy, root = lab
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    where = (copy / "chapters" / name).relative_to(root).as_posix()
    page.goto(f"{base}/lab/tree/{where}?reset&token={token}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=60_000)
    # the kernel is up when the execution indicator says idle
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook-ExecutionIndicator[data-status='idle']",
                           timeout=60_000)
    return page


def scroll_to_cell(page, i: int, tries: int = 3):
    """Scroll cell `i` into view. JupyterLab renders a long notebook as a windowed list and may replace a
    cell's element between finding it and scrolling to it ("Element is not attached to the DOM", seen in
    CI): then find it again."""
    from playwright.sync_api import Error
    for attempt in range(tries):
        try:
            return page.locator(".jp-NotebookPanel .jp-Cell").nth(i).scroll_into_view_if_needed()
        except Error as exc:
            if "not attached" not in str(exc) or attempt == tries - 1:
                raise
            page.wait_for_timeout(200)


def scroll_through(page):
    """Bring every cell into view once (lazily rendered cells and images load), back to the top."""
    n = page.locator(".jp-NotebookPanel .jp-Cell").count()
    for i in range(n):
        scroll_to_cell(page, i)
    page.wait_for_timeout(300)


def figure_refs(name) -> list[str]:
    nb = nbformat.read(REPO / "chapters" / name, as_version=4)
    return re.findall(r"!\[[^\]]*\]\((\.\./figures/[^)]+)\)", "\n".join(c.source for c in nb.cells
                                                                       if c.cell_type == "markdown"))


@pytest.mark.parametrize("name", CHAPTERS)
def test_chapter_renders_and_opening_leaves_it_unmodified(browser, lab, name):
    _, _, log, copy, _ = lab
    before = (copy / "chapters" / name).read_bytes()
    page = open_chapter(browser, lab, name)
    try:
        scroll_through(page)
        want = figure_refs(name)
        page.wait_for_function(
            "n => { const im = [...document.querySelectorAll('.jp-NotebookPanel .jp-RenderedMarkdown img')];"
            " return im.length >= n && im.every(i => i.complete); }", arg=len(want), timeout=30_000)
        imgs = page.eval_on_selector_all(".jp-NotebookPanel .jp-RenderedMarkdown img",
                                         "im => im.map(i => [i.getAttribute('src'), i.naturalWidth])")
        assert len(imgs) == len(want), (imgs, want)
        assert all(w > 0 for _, w in imgs), f"images that did not load: {[s for s, w in imgs if w == 0]}"
        has_math = "$" in "".join(c.source for c in nbformat.read(copy / "chapters" / name, as_version=4).cells
                                  if c.cell_type == "markdown")
        if has_math:
            page.wait_for_selector(".jp-NotebookPanel mjx-container", timeout=30_000)
        assert page.locator(".jp-NotebookPanel mjx-merror, .jp-NotebookPanel .MathJax_Error").count() == 0
        page.wait_for_timeout(1000)          # kernel_info_reply -> language_info written into the model
        page.screenshot(path=str(ARTIFACTS / f"{name[:-6]}.png"))
        dirty = page.locator(".lm-TabBar-tab.jp-mod-dirty").count()
        assert dirty == 0, f"{name} is marked modified just by opening it"
        page.keyboard.press("Control+s")
        page.wait_for_timeout(1500)
        assert (copy / "chapters" / name).read_bytes() == before, f"saving the untouched {name} changed it"
    finally:
        page.close()
    not_found = [l for l in log.read_text().splitlines() if " 404 " in l]
    assert not not_found, "\n".join(not_found)


def cell_output(page, i) -> str:
    return page.locator(".jp-NotebookPanel .jp-Cell").nth(i).locator(".jp-OutputArea").text_content()


def run_new_cell(page, source: str, until: str, timeout: int = 90_000) -> str:
    """Type `source` into a new cell below the current one, run it, wait until its output matches the regex
    `until`; return the output's text. The cell is looked up afresh at each poll (JupyterLab may re-render it) and
    kept in view."""
    page.keyboard.press("Escape")
    page.keyboard.press("b")
    page.keyboard.press("Enter")
    page.keyboard.insert_text(source)
    page.keyboard.press("Control+Enter")            # run it and stay on it
    active = ".jp-NotebookPanel .jp-Cell.jp-mod-active"
    page.wait_for_function(
        """([sel, pat]) => { const c = document.querySelector(sel); if (!c) return false;
                            c.scrollIntoView({block: "end"}); const o = c.querySelector('.jp-OutputArea');
                            return !!o && new RegExp(pat).test(o.textContent); }""",
        arg=[active, until], timeout=timeout)
    page.wait_for_timeout(500)
    return page.locator(active).locator(".jp-OutputArea").text_content()


def test_run_all_then_solve_e11(browser, lab):
    name = "01_rmsnorm.ipynb"
    nb = nbformat.read(REPO / "chapters" / name, as_version=4)
    checks = [i for i, c in enumerate(nb.cells) if "check" in c.metadata.get("tags", [])]
    exercise = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "NotImplementedError" in c.source)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    page = open_chapter(browser, lab, name)
    try:
        page.locator(".jp-NotebookPanel .jp-Cell").first.click()
        page.keyboard.press("Escape")
        page.locator("#jp-MainMenu").get_by_text("Run", exact=True).click()
        page.get_by_text("Run All Cells", exact=True).click()
        # a fresh kernel numbers the cells 1..n: the last one shows [n] once Run All got there
        last = page.locator(".jp-NotebookPanel .jp-Cell").nth(code[-1]).locator(".jp-InputPrompt")
        page.wait_for_function("([el, n]) => el.textContent.includes(`[${n}]`)",
                               arg=[last.element_handle(), len(code)], timeout=120_000)
        for i in checks:
            text = cell_output(page, i).strip()
            assert re.fullmatch(r"E1\.\d not done yet", text), f"check cell {i} printed {text!r}"
        scroll_to_cell(page, checks[0])
        page.wait_for_timeout(500)
        page.screenshot(path=str(ARTIFACTS / "01_run_all.png"))

        editor = page.locator(".jp-NotebookPanel .jp-Cell").nth(exercise).locator(".cm-content")
        editor.click()
        page.keyboard.press("Control+a")
        page.keyboard.press("Delete")
        page.keyboard.insert_text(E11)
        page.keyboard.press("Shift+Enter")          # run the exercise cell, move to its check cell
        page.keyboard.press("Shift+Enter")          # run the check
        page.wait_for_function(
            "el => /E1\\.1 ok/.test(el.textContent)",
            arg=page.locator(".jp-NotebookPanel .jp-Cell").nth(checks[0]).element_handle(), timeout=60_000)
        assert cell_output(page, checks[0]).strip() == "E1.1 ok"
        scroll_to_cell(page, checks[0])
        page.wait_for_timeout(500)
        page.screenshot(path=str(ARTIFACTS / "01_e11_ok.png"))

        # a progress bar is a widget (ipywidgets), not a pink stderr box
        page.keyboard.press("Escape")
        page.keyboard.press("b")                    # new cell below the check
        page.keyboard.press("Enter")
        page.keyboard.insert_text("from tqdm.auto import tqdm\nfor _ in tqdm(range(3)): pass")
        page.keyboard.press("Shift+Enter")
        try:
            page.wait_for_selector(".jp-NotebookPanel .jp-OutputArea .jupyter-widgets[class*='progress']", timeout=30_000)
        finally:
            page.screenshot(path=str(ARTIFACTS / "01_progress_bar.png"))
        assert page.locator(".jp-NotebookPanel [data-mime-type='application/vnd.jupyter.stderr']").count() == 0

        # `!python` is the kernel's Python (with torch), as in a Lab started by `make lab`
        out = run_new_cell(page, '!python -c "import torch; print(\'torch\', torch.__version__)"', r"torch \d|Error")
        assert re.match(r"torch \d", out.strip()), out
        # the export reads the saved notebook: before saving, it names the edited rms_norm
        out = run_new_cell(page, "from nanovllm_course.export import export_here\nrows = export_here(globals())",
                           r"not done yet\)|Error")
        page.screenshot(path=str(ARTIFACTS / "01_export_unsaved.png"))
        assert "this notebook runs another version of rms_norm (saved in chapter 01 as different code)" in out, out
        page.keyboard.press("Escape")
        page.keyboard.press("Control+s")
        page.wait_for_timeout(1500)
        out = run_new_cell(page, "rows = export_here(globals())", r"still the reference's|Error")
        assert "runs another version" not in out and "rms_norm               yours" in out, out
        page.screenshot(path=str(ARTIFACTS / "01_export_saved.png"))
    except BaseException:
        page.screenshot(path=str(ARTIFACTS / "01_failure.png"))
        raise
    finally:
        page.close()


# -- a browser client of the server ------------------------------------------------------------------------------
CHAT_PAGE = """<!doctype html><meta charset="utf-8"><title>chat client</title>
<pre id="answer"></pre><p id="status">starting</p>
<script>
// What a web client (Open WebUI's direct connections, the openai npm SDK in a browser) does: a cross-origin POST
// with JSON and an Authorization header (so the browser sends a CORS preflight first), then read the SSE stream.
(async () => {
  const status = document.getElementById("status"), answer = document.getElementById("answer");
  try {
    const server = new URLSearchParams(location.search).get("server");
    const res = await fetch(server + "/v1/chat/completions", {method: "POST",
      headers: {"Content-Type": "application/json", "Authorization": "Bearer none"},
      body: JSON.stringify({messages: [{role: "user", content: "Say something."}], max_tokens: 12, stream: true})});
    const reader = res.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let end;
      while ((end = buffer.indexOf("\\n\\n")) >= 0) {
        const event = buffer.slice(0, end); buffer = buffer.slice(end + 2);
        if (!event.startsWith("data: ")) continue;
        if (event === "data: [DONE]") { status.textContent = "done"; return; }
        const delta = JSON.parse(event.slice(6)).choices[0].delta;
        if (delta.content) answer.textContent += delta.content;
      }
    }
    status.textContent = "ended without [DONE]";
  } catch (err) { status.textContent = "error: " + err; }
})();
</script>"""


@pytest.fixture(scope="module")
def chat_page(tmp_path_factory):
    """The page's URL base, http://127.0.0.1:PORT/chat.html: another origin than any server's port."""
    import functools
    import http.server
    import threading
    root = tmp_path_factory.mktemp("page")
    (root / "chat.html").write_text(CHAT_PAGE)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/chat.html"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("allowed", ["any origin", "another origin only"])
def test_a_page_on_another_origin_streams_a_chat_answer(browser, chat_page, tmp_path, allowed):
    from serve_fake_engine import fake_answer
    from serve_helpers import ServerProcess, make_tokenizer_dir
    from transformers import AutoTokenizer

    from nanovllm_ref.llm import chat_token_ids
    model_dir = make_tokenizer_dir(tmp_path / "tok")
    args = ["--access-log"] + (["--allowed-origins", '["http://elsewhere.example"]'] if allowed != "any origin" else [])
    with ServerProcess(tmp_path, model_dir, {"step_delay": 0.02}, args=args) as server:
        page = browser.new_page()
        try:
            page.goto(f"{chat_page}?server={server.url}")
            page.wait_for_function("() => document.getElementById('status').textContent !== 'starting'",
                                   timeout=60_000)
            page.screenshot(path=str(ARTIFACTS / f"serve_cors_{allowed.replace(' ', '_')}.png"))
            status, shown = page.inner_text("#status"), page.inner_text("#answer")
        finally:
            page.close()
        log = server.log()
    if allowed == "any origin":
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        ids = chat_token_ids(tokenizer, [{"role": "user", "content": "Say something."}])
        assert (status, shown) == ("done", fake_answer(tokenizer, ids, 12)[0])
        assert '"OPTIONS /v1/chat/completions HTTP/1.1" 200' in log, log[-2000:]      # a real preflight came first
    else:                                     # the preflight is refused: the browser does not even send the POST
        assert status.startswith("error: TypeError") and shown == "", (status, shown)
        assert '"OPTIONS /v1/chat/completions HTTP/1.1" 400' in log and "POST /v1/chat" not in log, log[-2000:]
