"""README.md stays short, keeps its two set-up commands, links only to files that exist,
and its runnable blocks run.

Convention: a fenced block in README.md is runnable when the line right before its
opening fence is an HTML comment marker (invisible on GitHub):

- `<!-- runnable -->` before a ```python block: the block runs as a script in a
  subprocess (cwd: a temporary directory) and must exit 0. Such blocks use the built-in
  demo model and few tokens, so they take seconds.
- `<!-- runnable -->` before a ```bash block: every line is one `moestream ...` command
  (not `moestream serve`, which blocks); each runs with `shell=True` and must exit 0 and
  print something.
- `<!-- runnable: server -->` before a ```python block: a client of `moestream serve`.
  The test starts `moestream serve` (the demo model) on a free port, waits for `/health`,
  then runs the block with `127.0.0.1:8000` replaced by that port.

Other blocks (pip installs, placeholders such as DIR, servers) are documentation only.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from ports import free_port

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_LINES = 250
TIMEOUT = 300
SETUP_COMMANDS = (
    'pip install torch==2.13.0 && pip install -e . && moestream generate "def fibonacci(n):"',
    'pip install torch==2.13.0 && pip install -e ".[test,ray]" && python -m pytest -q -n 2 --dist loadfile',
)
MARKER = re.compile(r"^<!--\s*runnable(?::\s*(?P<kind>[\w-]+))?\s*-->$")
FENCE = re.compile(r"^```(?P<lang>\w*)\s*$")


def fenced_blocks(text: str) -> list[tuple[str, str, str | None, int]]:
    """(language, body, marker kind, line number) of every fenced block; the marker kind
    is None for an unmarked block, "" for `<!-- runnable -->`, else the `runnable: KIND`."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start = i
        marker = MARKER.match(lines[i - 1].strip()) if i > 0 else None
        kind = None if marker is None else (marker.group("kind") or "")
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        blocks.append((m.group("lang"), "\n".join(body) + "\n", kind, start + 1))
        i += 1
    return blocks


def runnable(kind: str, lang: str) -> list[tuple[str, int]]:
    """(body, line number) of README's blocks of language `lang` marked `kind`."""
    return [(body, line) for lg, body, k, line in fenced_blocks(README.read_text()) if k == kind and lg == lang]


def _ids(blocks: list[tuple[str, int]]) -> list[str]:
    return [f"README.md:{line}" for _, line in blocks]


def _run(cmd: list[str] | str, cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT, **kwargs)


def _explain(what: str, proc: subprocess.CompletedProcess) -> str:
    return f"{what} exited {proc.returncode}\n--- stdout:\n{proc.stdout[-4000:]}\n--- stderr:\n{proc.stderr[-4000:]}"


def test_readme_is_short() -> None:
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; at most {MAX_LINES} (move details to docs/)"


@pytest.mark.parametrize("command", SETUP_COMMANDS)
def test_setup_commands_verbatim(command: str) -> None:
    lines = [line.strip() for _, body, _, _ in fenced_blocks(README.read_text()) for line in body.splitlines()]
    assert command in lines, f"README.md lost its set-up command: {command}"


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q -n 2 --dist loadfile" in ci and SETUP_COMMANDS[1] in README.read_text()


def test_there_are_runnable_blocks() -> None:
    assert runnable("", "python") and runnable("", "bash"), "README.md lost its <!-- runnable --> blocks"


def _markdown_files() -> list[Path]:
    return [README] + sorted(p for p in DOCS.glob("*.md") if p.name != "structure.md")


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    text = path.read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # links inside code are not links
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (path.parent / target.split("#")[0]).exists():
            missing.append(target)
    assert not missing, f"{path.relative_to(ROOT)} links to missing files: {missing}"


def test_readme_links_every_docs_page() -> None:
    text = README.read_text()
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    unlinked = [p for p in pages if f"](docs/{p})" not in text]
    assert not unlinked, f"README.md's links do not list {unlinked}"


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_local_paths(path: Path) -> None:
    text = path.read_text()
    for bad in ("/tmp", "../shared", "this machine"):
        assert bad not in text, f"{path.relative_to(ROOT)} mentions {bad!r}"


@pytest.mark.parametrize("block", runnable("", "python"), ids=_ids(runnable("", "python")))
def test_python_block_runs(block: tuple[str, int], tmp_path: Path) -> None:
    body, line = block
    script = tmp_path / "block.py"
    script.write_text(body)
    proc = _run([sys.executable, str(script)], tmp_path)
    assert proc.returncode == 0, _explain(f"README.md:{line} python block", proc)


@pytest.mark.parametrize("block", runnable("", "bash"), ids=_ids(runnable("", "bash")))
def test_bash_block_runs(block: tuple[str, int], tmp_path: Path) -> None:
    body, line = block
    assert shutil.which("moestream"), "the moestream console script is not installed (pip install -e .)"
    commands = [c for c in body.splitlines() if c.strip() and not c.lstrip().startswith("#")]
    for command in commands:
        assert command.startswith("moestream ") and not command.startswith("moestream serve"), (
            f"README.md:{line}: a runnable bash block holds only `moestream ...` commands that return, got {command!r}")
        proc = _run(command, tmp_path, shell=True)
        assert proc.returncode == 0, _explain(command, proc)
        assert proc.stdout.strip(), f"{command} printed nothing"



def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"moestream serve exited {proc.returncode} before answering /health")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"moestream serve did not answer {url} within {timeout} s")


@pytest.mark.parametrize("block", runnable("server", "python"), ids=_ids(runnable("server", "python")))
def test_server_client_block_runs(block: tuple[str, int], tmp_path: Path) -> None:
    pytest.importorskip("openai")
    body, line = block
    assert "127.0.0.1:8000" in body, f"README.md:{line}: a server block talks to 127.0.0.1:8000"
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(shlex.split(f"moestream serve --port {port}"), cwd=tmp_path, stdout=log,
                              stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/health", server, TIMEOUT)
        script = tmp_path / "client.py"
        script.write_text(body.replace("127.0.0.1:8000", f"127.0.0.1:{port}"))
        proc = _run([sys.executable, str(script)], tmp_path)
        assert proc.returncode == 0, _explain(f"README.md:{line} server client block", proc)
        assert proc.stdout.strip()
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
