"""The runtime never imports torch (nor the export stage): checked in a fresh interpreter."""
import subprocess
import sys
import textwrap

FORBIDDEN = ("torch", "transformers", "optimum", "nncf", "ovdflash_export")


def run_isolated(code):
    code = textwrap.dedent(code) + textwrap.dedent(CHECK)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


CHECK = f"""
    loaded = sorted({{m.split('.')[0] for m in sys.modules}} & set({FORBIDDEN!r}))
    print('FORBIDDEN', loaded)
"""


def test_importing_the_runtime_does_not_import_torch():
    out = run_isolated("""
        import sys
        import ovdflash, ovdflash.pipeline, ovdflash.cli.chat, ovdflash.ov.runners, ovdflash.decode.sequence
        from ovdflash.cli import main
        main.get_command(None, "chat")
    """)
    assert "FORBIDDEN []" in out, out


def test_running_the_pipeline_does_not_import_torch(tiny_pair, tmp_path):
    out = run_isolated(f"""
        import sys
        from ovdflash import DFlashPipeline
        pipe = DFlashPipeline.from_pretrained({str(tiny_pair)!r}, cache_dir={str(tmp_path)!r})
        r1 = pipe.generate("hello", max_new_tokens=12, block_size=pipe.block_size)
        r2 = pipe.generate([{{"role": "user", "content": "hi"}}], max_new_tokens=12, temperature=0.8, seed=1,
                           block_size="auto")
        assert len(r1.token_ids) > 0 and len(r2.token_ids) > 0
        print('DRAFTS', pipe.stats.num_drafts)
    """)
    assert "FORBIDDEN []" in out, out
    assert "DRAFTS 0" not in out  # the speculative path really ran
