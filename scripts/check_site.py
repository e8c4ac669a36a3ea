#!/usr/bin/env python3
"""Check the built book (_build/html) in a real browser.

Serves _build/html on 127.0.0.1, opens every HTML page in Debian's Chromium (headless, driven
by Playwright; Playwright's own browser is never downloaded) and fails on:

- a console error or an uncaught page error;
- a failed or non-2xx request for a resource of the site, or any request that leaves the
  site (such requests are blocked, as on a machine without network access);
- an <img> that did not decode (naturalWidth == 0);
- unrendered math: MathJax missing or not finished, a math element without MathJax output,
  a MathJax error, or raw TeX ($$, \\(, \\[, \\begin{...}) left in the visible text;
- a notebook traceback on a page, or an error output in an executed notebook under
  book/executed/.

Writes a full-page screenshot of every page to _build/site-check/. Prints one line per page
and a summary; exits non-zero on any failure.
"""
from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "_build" / "html"
EXECUTED = ROOT / "book" / "executed"
SHOTS = ROOT / "_build" / "site-check"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
    "--disable-default-apps",
    "--disable-extensions",
]

# Runs in the page after load: waits for MathJax, forces and awaits image decoding, then
# reports what it found.
PAGE_PROBE = r"""
async (mathjaxTimeoutMs) => {
  const report = {mathElements: 0, mathjaxLoaded: false, mathjaxDone: false, mathjaxError: null,
                  unrendered: [], mathErrors: [], badImages: [], images: 0, rawTex: [],
                  tracebacks: 0, tablesAsFigures: []};
  const sphinxMath = Array.from(document.querySelectorAll('div.math, span.math'));
  report.mathElements = sphinxMath.length;
  const mathjaxScript = Array.from(document.scripts).some(s => /mathjax/i.test(s.src || ''));
  if (sphinxMath.length > 0 || mathjaxScript) {
    // The MathJax script is deferred, so after the load event it has run or failed;
    // allow a short grace period for MathJax.startup to appear.
    const t0 = performance.now();
    while (!(window.MathJax && window.MathJax.startup && window.MathJax.startup.promise)) {
      if (performance.now() - t0 > Math.min(mathjaxTimeoutMs, 3000)) break;
      await new Promise(r => setTimeout(r, 50));
    }
    if (window.MathJax && window.MathJax.startup && window.MathJax.startup.promise) {
      report.mathjaxLoaded = true;
      try {
        await Promise.race([
          window.MathJax.startup.promise.then(() => { report.mathjaxDone = true; }),
          new Promise(r => setTimeout(r, mathjaxTimeoutMs)),
        ]);
      } catch (e) { report.mathjaxError = String(e); }
    }
    for (const el of sphinxMath) {
      if (!el.querySelector('mjx-container')) {
        report.unrendered.push((el.textContent || '').trim().slice(0, 80));
      }
    }
    // TeX errors render as merror; undefined macros (noundefined) as red mtext.
    for (const c of document.querySelectorAll('mjx-container')) {
      const mml = c.querySelector('mjx-assistive-mml');
      const bad = c.querySelector('mjx-merror, [data-mjx-error], mjx-mtext[style*="color: red"]') ||
                  (mml && mml.querySelector('merror, [mathcolor="red"]'));
      if (bad) {
        const what = bad.getAttribute('data-mjx-error') || (mml ? mml.textContent : '') || '';
        report.mathErrors.push(what.trim().slice(0, 80));
      }
    }
  }
  // Images: load lazy ones, wait for decoding, then look at naturalWidth.
  const imgs = Array.from(document.images);
  report.images = imgs.length;
  for (const img of imgs) { if (img.loading === 'lazy') img.loading = 'eager'; }
  await Promise.all(imgs.map(img => Promise.race([
    img.decode().catch(() => null),
    new Promise(r => setTimeout(r, 10000)),
  ])));
  for (const img of imgs) {
    if (!img.complete || img.naturalWidth === 0) report.badImages.push(img.getAttribute('src'));
  }
  // Raw TeX in the visible text, outside code, scripts and rendered math.
  const skip = 'pre, code, script, style, textarea, noscript, mjx-container, .highlight, .MathJax';
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const patterns = [/\$\$/, /\\\(/, /\\\)/, /\\\[/, /\\\]/, /\\begin\{/, /\$[^$\n]*[\\^_][^$\n]*\$/];
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const parent = n.parentElement;
    if (!parent || parent.closest(skip)) continue;
    if (parent.closest('[hidden], [aria-hidden="true"]')) continue;
    const style = getComputedStyle(parent);
    if (style.display === 'none' || style.visibility === 'hidden') continue;
    const text = n.textContent;
    if (patterns.some(p => p.test(text))) report.rawTex.push(text.trim().slice(0, 80));
  }
  // A table captioned as a figure ("Fig. N"): tables are numbered as tables.
  report.tablesAsFigures = Array.from(document.querySelectorAll('figure'))
      .filter(f => f.querySelector('table') && /^Fig/.test((f.querySelector('.caption-number') || {}).textContent || ''))
      .map(f => (f.querySelector('.caption-number').textContent || '').trim());
  report.tracebacks = document.querySelectorAll(
      '.output.traceback, .cell_output .traceback, pre.traceback').length;
  return report;
}
"""


def ensure_chromium() -> None:
    if CHROMIUM.exists():
        return
    print(f"check_site: {CHROMIUM} missing; installing Debian's chromium with apt-get", flush=True)
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(sudo + ["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(sudo + ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium"],
                   check=True, env=env)
    if not CHROMIUM.exists():
        sys.exit(f"check_site: apt-get finished but {CHROMIUM} is still missing")


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # noqa: D401 - silence per-request logging
        pass


def serve(directory: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    return server, f"http://{host}:{port}"


def site_pages(site: Path) -> list[str]:
    pages = []
    for path in sorted(site.rglob("*.html")):
        rel = path.relative_to(site)
        if rel.parts[0] in ("_static", "_sources", "_images"):
            continue
        pages.append(rel.as_posix())
    return pages


def notebook_errors(folder: Path) -> list[str]:
    problems = []
    for nb_path in sorted(folder.rglob("*.ipynb")):
        if ".ipynb_checkpoints" in nb_path.parts:
            continue
        try:
            nb = json.loads(nb_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            problems.append(f"{nb_path.relative_to(ROOT)}: unreadable ({exc})")
            continue
        for i, cell in enumerate(nb.get("cells", [])):
            for out in cell.get("outputs", []) or []:
                if out.get("output_type") == "error":
                    problems.append(f"{nb_path.relative_to(ROOT)}: cell {i} "
                                    f"(In [{cell.get('execution_count')}]) has an error output: "
                                    f"{out.get('ename')}: {out.get('evalue')}")
        if nb.get("metadata", {}).get("papermill", {}).get("exception"):
            problems.append(f"{nb_path.relative_to(ROOT)}: papermill recorded an exception")
    return problems


def check_page(context, base: str, rel: str, timeout_ms: int, shots: Path | None) -> tuple[list[str], str]:
    problems: list[str] = []
    page = context.new_page()
    origin = urlsplit(base).netloc

    def on_console(msg):
        if msg.type == "error":
            loc = msg.location or {}
            where = f" ({loc.get('url', '')}:{loc.get('lineNumber', '')})" if loc.get("url") else ""
            problems.append(f"console error: {msg.text}{where}")

    def on_request_failed(req):
        if urlsplit(req.url).netloc == origin:
            problems.append(f"request failed: {req.url} ({req.failure})")

    def on_response(resp):
        if urlsplit(resp.url).netloc == origin and resp.status >= 400:
            problems.append(f"HTTP {resp.status}: {resp.url}")

    page.on("console", on_console)
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("requestfailed", on_request_failed)
    page.on("response", on_response)
    try:
        resp = page.goto(f"{base}/{rel}", wait_until="load", timeout=timeout_ms)
        if resp is None or not resp.ok:
            problems.append(f"page load returned {resp.status if resp else 'nothing'}")
        try:
            page.wait_for_load_state("networkidle", timeout=timeout_ms)
        except Exception:  # noqa: BLE001 - a page that keeps polling is reported below if it errs
            problems.append("network did not go idle")
        report = page.evaluate(PAGE_PROBE, timeout_ms)
        if report["mathElements"] and not report["mathjaxLoaded"]:
            problems.append(f"{report['mathElements']} math element(s) but MathJax did not load")
        elif report["mathjaxLoaded"] and not report["mathjaxDone"]:
            problems.append("MathJax did not finish typesetting" +
                            (f": {report['mathjaxError']}" if report["mathjaxError"] else ""))
        for text in report["unrendered"]:
            problems.append(f"unrendered math: {text!r}")
        for text in report["mathErrors"]:
            problems.append(f"MathJax error: {text!r}")
        for src in report["badImages"]:
            problems.append(f"image not decoded: {src}")
        for text in report["rawTex"]:
            problems.append(f"raw TeX in visible text: {text!r}")
        for caption in report["tablesAsFigures"]:
            problems.append(f"a table captioned as a figure: {caption!r}")
        if report["tracebacks"]:
            problems.append(f"{report['tracebacks']} traceback output(s) on the page")
        if shots is not None:
            target = shots / (rel.removesuffix(".html") + ".png")
            target.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(target), full_page=True)
        page.wait_for_timeout(100)  # let late console messages arrive
        summary = f"math {report['mathElements']}, images {report['images']}"
    except Exception as exc:  # noqa: BLE001
        problems.append(f"check aborted: {exc}")
        summary = "not checked"
    finally:
        page.close()
    return problems, summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--site", type=Path, default=SITE, help="built site (default: _build/html)")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per page (default: 30)")
    ap.add_argument("--no-screenshots", action="store_true", help=f"skip the screenshots in {SHOTS.relative_to(ROOT)}/")
    args = ap.parse_args()

    site = args.site.resolve()
    if not (site / "index.html").is_file():
        print(f"check_site: no built site at {site} (run `make book` first)", file=sys.stderr)
        return 1
    failures: list[str] = []

    for problem in notebook_errors(EXECUTED):
        print(f"FAIL notebook {problem}")
        failures.append(problem)

    ensure_chromium()
    from playwright.sync_api import sync_playwright

    pages = site_pages(site)
    shots = None if args.no_screenshots else SHOTS
    if shots is not None:
        shutil.rmtree(shots, ignore_errors=True)
        shots.mkdir(parents=True)
    server, base = serve(site)
    origin = urlsplit(base).netloc
    blocked: list[str] = []
    start = time.monotonic()
    failed_pages = 0
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)

            def route(r):
                url = r.request.url
                if urlsplit(url).netloc == origin or url.startswith(("data:", "blob:")):
                    r.continue_()
                else:
                    blocked.append(url)
                    r.abort("blockedbyclient")

            for rel in pages:
                before = len(blocked)
                # A fresh context per page: empty storage and cache, as on a first visit.
                context = browser.new_context(viewport={"width": 1280, "height": 900},
                                              service_workers="block")
                context.route("**/*", route)
                try:
                    problems, summary = check_page(context, base, rel, int(args.timeout * 1000), shots)
                finally:
                    context.close()
                problems += [f"external request blocked: {u}" for u in blocked[before:]]
                if problems:
                    failed_pages += 1
                    print(f"FAIL {rel} ({summary})")
                    for p in problems:
                        print(f"     - {p}")
                        failures.append(f"{rel}: {p}")
                else:
                    print(f"ok   {rel} ({summary})")
            browser.close()
    finally:
        server.shutdown()

    elapsed = time.monotonic() - start
    print(f"check_site: {len(pages)} page(s) checked in {elapsed:.1f}s, {failed_pages} failed; "
          f"{len(failures)} problem(s) in total" + (f"; screenshots in {shots.relative_to(ROOT)}/" if shots else ""))
    if failures:
        print("check_site: FAILED", file=sys.stderr)
        return 1
    print("check_site: all pages passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
