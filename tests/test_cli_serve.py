"""`moestream serve`'s start-up checks: the chat template and the port are checked before the
model loads; "serving ..." is logged only once the server has bound its port."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from moestream.server.cli import check_port_free, load_chat_template, main

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"


def test_load_chat_template_inline_or_file(tmp_path: Path) -> None:
    assert load_chat_template(TEMPLATE) == TEMPLATE  # Jinja syntax: the template itself
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE  # no Jinja syntax: a file
    # what transformers' templates may use beyond plain Jinja parses too
    extras = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% break %}{% endfor %}"
    assert load_chat_template(extras) == extras


def test_load_chat_template_errors(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.jinja")
    with pytest.raises(ValueError, match=f"--chat-template file '{re.escape(missing)}' does not exist"):
        load_chat_template(missing)
    with pytest.raises(ValueError, match="the inline template is not a valid Jinja template: .*line 1"):
        load_chat_template("{{ messages[0].content")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m.content }}\n")
    with pytest.raises(ValueError, match=f"template file '{re.escape(str(bad))}' is not a valid Jinja template"):
        load_chat_template(str(bad))


def test_serve_chat_template_errors_come_before_the_model_loads(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    missing = str(tmp_path / "missing.jinja")
    # MODEL_DIR does not exist either: the error is about the template, so it was checked first.
    assert main(["serve", str(tmp_path / "no-model"), "--port", "0", "--chat-template", missing]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --chat-template file '{missing}' does not exist "
                   "(a value without '{{' or '{%' is the path of a template file)\n")
    assert main(["serve", str(tmp_path / "no-model"), "--port", "0", "--chat-template", "{% if %}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --chat-template: the inline template is not a valid Jinja template")
    assert err.count("\n") == 1
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert main(["serve", str(tmp_path / "no-model"), "--port", "0", "--chat-template", str(path)]) == 2
    assert "model directory" in capsys.readouterr().err  # a good template: on to the model


def test_serve_fails_fast_on_a_port_in_use(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match="address already in use"):
            check_port_free("127.0.0.1", port)
        # MODEL_DIR does not exist: the error is about the port, so it was checked first.
        assert main(["serve", str(tmp_path / "no-model"), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot listen on 127.0.0.1:{port}: address already in use (")
    assert err.count("\n") == 1 and "serving" not in err
    check_port_free("127.0.0.1", port)  # free again once the listener closed


def test_serve_passes_its_flags_to_server_config(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    import moestream.server.serving as serving

    seen = []

    def config(**kwargs: object) -> None:
        seen.append(kwargs)
        raise ValueError("stop before the model loads")

    monkeypatch.setattr(serving, "ServerConfig", config)
    assert main(["serve", "--port", "0", "--threads", "2", "--chat-template", TEMPLATE]) == 2
    assert main(["serve", "--port", "0", "--enable-log-requests", "--served-model-name", "a", "b"]) == 2
    assert capsys.readouterr().err.count("error: stop before the model loads\n") == 2
    assert seen[0]["enable_log_requests"] is False and seen[1]["enable_log_requests"] is True
    assert seen[0]["chat_template"] == TEMPLATE and seen[0]["engine_threads"] == 2
    assert seen[1]["served_model_names"] == ("a", "b")


def test_serve_logs_serving_once_bound(qwen3_moe_dir: str) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "moestream.server.cli", "serve", qwen3_moe_dir, "--port", "0",
                             "--dtype", "float32", "--max-model-len", "64", "--served-model-name", "m"],
                            stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if " serving " in line:
                break
        log = "".join(lines)
        assert " serving " in lines[-1], log
        m = re.search(r"serving (\S+) as m on http://127\.0\.0\.1:(\d+)/v1 \(engine threads: \d+\)", lines[-1])
        assert m and m.group(1) == qwen3_moe_dir, log
        port = int(m.group(2))
        assert port != 0 and f"Uvicorn running on http://127.0.0.1:{port}" in log  # the bound port, once bound
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
