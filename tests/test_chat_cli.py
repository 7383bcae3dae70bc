"""`ovdflash chat` end to end on a tiny exported pair: --prompt, and the interactive mode in a pty."""
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

CLI = [sys.executable, "-m", "ovdflash.cli", "chat"]


def test_chat_prompt_one_reply(tiny_pair, tmp_path):
    # the default block size is "auto": with the tiny random drafter it mostly steps AR
    proc = subprocess.run(CLI + [str(tiny_pair), "--prompt", "Hello there", "-n", "16", "--cache-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("tok/s") == 1  # one stats line


def test_chat_fixed_and_bad_block_size(tiny_pair, tmp_path):
    proc = subprocess.run(CLI + [str(tiny_pair), "--prompt", "Hello there", "-n", "16", "--block-size", "4",
                                 "--cache-dir", str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "accept len" in proc.stderr  # a fixed block drafts every round
    proc = subprocess.run(CLI + [str(tiny_pair), "--prompt", "x", "--block-size", "big"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "--block-size" in proc.stderr


def test_chat_prompt_lookup_flag_changes_rounds_not_output(tiny_pair, tmp_path):
    args = [str(tiny_pair), "--prompt", "ab ab ab ab ab ab ab ab ab", "-n", "24", "--block-size", "4",
            "--cache-dir", str(tmp_path)]
    on, off = (subprocess.run(CLI + args + [flag], capture_output=True, text=True, timeout=240)
               for flag in ("--prompt-lookup", "--no-prompt-lookup"))
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    assert on.stdout == off.stdout and on.stdout.strip()  # greedy: the same reply either way
    assert "drafted by lookup" in on.stderr and "drafted by lookup" not in off.stderr


def test_chat_no_draft_and_sampling_flags(tiny_pair, tmp_path):
    args = ["--prompt", "Hi", "-n", "8", "--no-draft", "--temperature", "0.7", "--top-k", "20",
            "--top-p", "0.9", "--seed", "3", "--block-size", "3", "--cache-dir", str(tmp_path)]
    runs = [subprocess.run(CLI + [str(tiny_pair)] + args, capture_output=True, text=True, timeout=240)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    assert runs[0].stdout == runs[1].stdout  # seeded
    assert "accept len" not in runs[0].stderr  # --no-draft: plain AR
    stateful = subprocess.run(CLI + [str(tiny_pair)] + args + ["--target-runner", "stateful"], capture_output=True,
                              text=True, timeout=240)
    assert stateful.returncode == 0 and stateful.stdout.strip(), stateful.stderr
    bad = subprocess.run(CLI + [str(tiny_pair), "--prompt", "x", "--target-runner", "pagd"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and "--target-runner" in bad.stderr


def test_chat_rejects_bad_parameters(tiny_pair):
    proc = subprocess.run(CLI + [str(tiny_pair), "--prompt", "x", "--top-p", "0"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "top_p" in proc.stderr


class PtySession:
    def __init__(self, argv):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # child: the pty is its controlling terminal, so Ctrl-C is a real SIGINT
            # as a shell does for a foreground job: a runner that started pytest in the background
            # (`cmd &` without job control) left SIGINT ignored, and Python keeps an ignored SIGINT
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execv(argv[0], argv)
        self.buffer = b""

    def expect(self, needle, timeout=120):
        deadline = time.time() + timeout
        while needle.encode() not in self.buffer:
            remaining = deadline - time.time()
            if remaining <= 0:
                raise AssertionError(f"timed out waiting for {needle!r}; got {self.buffer.decode(errors='replace')!r}")
            ready, _, _ = select.select([self.fd], [], [], remaining)
            if ready:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:
                    chunk = b""
                if not chunk:
                    raise AssertionError(f"session ended before {needle!r}: {self.buffer.decode(errors='replace')!r}")
                self.buffer += chunk
        before, _, self.buffer = self.buffer.partition(needle.encode())
        return before.decode(errors="replace")

    def send(self, text):
        os.write(self.fd, text.encode())

    def wait(self, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                os.read(self.fd, 4096)
            except OSError:
                pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        os.kill(self.pid, 9)
        raise AssertionError("chat did not exit")


def test_chat_interactive_in_a_pty(tiny_pair, tmp_path):
    session = PtySession(CLI + [str(tiny_pair), "-n", "12", "--block-size", "4", "--cache-dir", str(tmp_path)])
    session.expect(">>> ")
    session.send("Hello there\n")
    session.expect("tok/s")                # the reply streamed, then one stats line
    session.expect(">>> ")
    # Give readline time to enter its select(): a SIGINT that lands between the prompt being
    # printed and that select() is only seen at the next key (a CPython readline race that no
    # human can hit, but a loaded test machine can).
    time.sleep(1.0)
    session.send("\x03")                   # Ctrl-C at the prompt keeps the session
    try:
        session.expect(">>> ", timeout=15)
    except AssertionError:                 # lost in that race anyway (CI hosts are busy): a second one
        session.send("\x03")               # is seen, and is also a Ctrl-C at the prompt
        session.expect(">>> ")
    session.send("And again?\n")
    session.expect("tok/s")
    session.expect(">>> ")
    session.send("/stats\n")
    report = session.expect(">>> ")
    assert "drafts" in report and "per-position acceptance" in report
    assert re.search(r"\d+ tok in", report)  # cumulative over both turns
    session.send("/reset\n")
    session.expect("[conversation reset]")
    session.send("/quit\n")
    assert session.wait() == 0


def test_ctrl_c_stops_the_reply_and_keeps_the_session(monkeypatch):
    """In-process with the mock pipeline: a KeyboardInterrupt mid-reply (Ctrl-C) ends that reply only."""
    from click.testing import CliRunner
    from test_engine_mock import text_pipeline

    import ovdflash.pipeline
    from ovdflash.cli.chat import chat

    pipe = text_pipeline()
    seen_messages = []
    real_stream = pipe.stream

    def stream(messages, **kwargs):
        seen_messages.append([dict(m) for m in messages])
        for i, chunk in enumerate(real_stream(messages, **kwargs)):
            if len(seen_messages) == 1 and i == 2:
                raise KeyboardInterrupt  # what Ctrl-C does while the first reply streams
            yield chunk

    pipe.stream = stream
    monkeypatch.setattr(ovdflash.pipeline.DFlashPipeline, "from_pretrained", classmethod(lambda cls, *a, **k: pipe))
    result = CliRunner().invoke(chat, ["-n", "20"], input="hello\nagain\n/stats\n/quit\n")
    assert result.exit_code == 0, result.output
    assert "[stopped]" in result.output
    assert len(seen_messages) == 2
    partial = seen_messages[1][1]
    assert partial["role"] == "assistant" and 0 < len(partial["content"])  # the partial reply is kept
    assert seen_messages[1][2] == {"role": "user", "content": "again"}
    assert pipe.stats.num_calls == 2  # the interrupted call was recorded too


def test_prompt_longer_than_the_context_is_a_clear_error(monkeypatch):
    from click.testing import CliRunner
    from test_engine_mock import text_pipeline

    import ovdflash.pipeline
    from ovdflash.cli.chat import chat

    pipe = text_pipeline()
    pipe.target.max_length = 32
    monkeypatch.setattr(ovdflash.pipeline.DFlashPipeline, "from_pretrained", classmethod(lambda cls, *a, **k: pipe))
    result = CliRunner().invoke(chat, ["--prompt", "x" * 40])
    assert result.exit_code == 1
    assert "context limit is 32" in result.output
    # interactive: the error keeps the session, and the failed turn is not added to the history
    result = CliRunner().invoke(chat, [], input="y" * 40 + "\nhi\n/quit\n")
    assert result.exit_code == 0 and "context limit is 32" in result.output and "tok/s" in result.output


def test_chat_template_and_streaming_decode_match_transformers(tiny_pair):
    """Our jinja2 rendering + `tokenizers` encoding equal transformers' apply_chat_template (the test
    may import transformers; the runtime never does), and streamed decoding equals a full decode."""
    from transformers import AutoTokenizer

    from ovdflash.tokenizer import IncrementalDetokenizer, Tokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_pair))
    ours = Tokenizer.from_dir(tiny_pair)
    conversations = [
        [{"role": "user", "content": "Hi there! \U0001F600"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"},
         {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    ]
    for messages in conversations:
        for gen_prompt in (True, False):
            text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen_prompt) == text
            assert ours.encode_chat(messages, gen_prompt) == hf(text, add_special_tokens=False)["input_ids"]
    text = "Hello w\u00f6rld \u2014 \u4f60\u597d \U0001F600 def f(x):\n    return x"
    ids = ours.encode(text)
    detok = IncrementalDetokenizer(ours)
    deltas = [detok.add([i]) for i in ids]
    assert "".join(deltas) + detok.flush() == hf.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in d for d in deltas)


def test_a_subcommand_that_cannot_be_imported_is_a_one_line_error(monkeypatch):
    from click.testing import CliRunner

    from ovdflash import cli

    monkeypatch.setitem(cli._COMMANDS, "verify", ("ovdflash.cli.no_such_module", "verify", "Check a model directory."))
    res = CliRunner().invoke(cli.main, ["verify"])
    assert res.exit_code == 1, res.output
    assert res.output.strip() == ("Error: `ovdflash verify` is unavailable: "
                                  "No module named 'ovdflash.cli.no_such_module'"), res.output
