"""`ovdflash chat` with no arguments runs on the embedded default model.

Fast: the default resolver is patched to a tiny exported pair, so the test checks the wiring
(no MODEL_DIR -> `ensure_default_model()` -> load -> interactive turn -> stats line -> /quit).
Slow: the real thing in a fresh process (fetches SmolLM2 and exports the pair on first use).
"""
import subprocess
import sys

import pytest
from click.testing import CliRunner


def test_chat_without_arguments_uses_the_embedded_default(tiny_pair, monkeypatch):
    from ovdflash.cli import main
    from ovdflash_models import default as default_mod

    calls = []

    def fake_default(*args, **kwargs):
        calls.append(1)
        return tiny_pair

    monkeypatch.setattr(default_mod, "ensure_default_model", fake_default)
    result = CliRunner().invoke(main, ["chat"], input="Hello there\n/quit\n")
    assert result.exit_code == 0, result.output
    assert calls == [1]
    assert "tok/s" in result.output and "accept len" in result.output  # one reply, speculative


@pytest.mark.slow
def test_real_chat_without_arguments_answers():
    proc = subprocess.run([sys.executable, "-m", "ovdflash.cli", "chat"], input=(
        "Write a Python function that reverses a string.\n/quit\n"), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "def " in proc.stdout and ("[::-1]" in proc.stdout or "reverse" in proc.stdout), proc.stdout
    assert "tok/s" in proc.stderr and "accept len" in proc.stderr
